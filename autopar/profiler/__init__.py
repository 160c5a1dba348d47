"""Measure the machine it runs on and write a hardware profile: ``autopar profile``.

In: a `ProfileOptions` (the output file, ranks, quick or full). Out: a profile TOML in the
schema of ``hardware_profiles/README.md`` that `autopar.Cluster.from_profile(path)` loads, with
the raw measurements it was fitted to in its ``[measured]`` table.

Modules:
    compute   matmul (fp32, bf16), attention, memory copy, elementwise, launch overhead
    comm      all-reduce, all-gather, reduce-scatter, all-to-all, send/recv per topology level
    document  fits (`cost_models.fit`) and the TOML text
    run       the driver: launches itself under torchrun, measures, writes on rank 0
    check     a second's probe of a few ops against a CPU profile's prices: does it still
              describe this machine?
"""

from autopar.profiler.run import ProfileOptions, profile

__all__ = ["ProfileOptions", "profile"]
