"""solve: ModelGraph + Cluster + batch -> the fastest ParallelConfig that fits (outer search),
and per layer class the placements of its nodes (intra-layer ILP, `autopar.solve.intra`)."""
