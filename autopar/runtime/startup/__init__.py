"""How a generated program starts: the model built on the meta device, parallelised there,
then each rank's own shards made -- by its initialization, replayed at the shard's elements,
or read from a pretrained checkpoint.

Modules:
    rng          a counter-based generator: the draw at an element depends on (key, position)
    record       the build on meta, recorded: how each parameter's and buffer's value is made
    replay       that record evaluated at chosen elements (a shard's), on any device
"""
