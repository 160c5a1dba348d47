"""How a generated program starts: the model built on the meta device, parallelised there,
then each rank's own shards made -- by its initialization, replayed at the shard's elements,
or read from a pretrained checkpoint. No rank holds more of any parameter than its plan's
share at any moment (`tests/autopar/runtime/test_startup_memory.py`).

Modules:
    rng            a counter-based generator: the draw at an element depends on (key, position)
    record         the build on meta, recorded: how each parameter's and buffer's value is made
    replay         that record evaluated at chosen elements (a shard's), on any device
    regions        which elements of the whole tensor a rank's local tensor holds
    materialize    to_empty, then every parameter and buffer filled from a weight source
    hf_checkpoint  a Hugging Face checkpoint as a weight source, read shard by shard
    start          the sequence: record, check, parallelise, materialize, report
"""
