"""Which layers run where: model chunks, pipeline stages and the layers a policy recomputes.

In: the model's layer tables in order, a `ParallelConfig` and, for a balanced split, each
layer's time. Out: pp * v model chunks (lists of layers), the layers of each pipeline stage,
and the names of the layers the recompute policy wraps and of those whose activations are
offloaded to the host. Pure functions: the estimator caches
their results.

Chunks: the blocks (repeated layers) split into pp * v contiguous groups; the layers before
the first block ride on chunk 0, those after the last block on the last chunk. With
`ParallelConfig.pipeline_slots` the embedding and/or the loss count as one block each in the
(even) split, so chunk 0 or the last may hold no block at all. Megatron's even
split puts the extra blocks in the middle chunks; the balanced split minimises the slowest
chunk's forward + backward (`linear_partition`), the embedding and the head counting with the
first and last block. Chunk k runs on stage k mod pp (interleaved schedules), or on the V of
DualPipe-V: chunks 0 .. pp-1 down the stages, pp .. 2pp-1 back up (`stage_of_chunk`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from autopar.config import ParallelConfig
from autopar.errors import ConfigError
from autopar.estimate.tables import LayerTable

Chunks = list[list[LayerTable]]


def split_chunks(
    layers: tuple[LayerTable, ...],
    cfg: ParallelConfig,
    balanced_sizes: Callable[[list[int], int], list[int]] | None = None,
) -> Chunks:
    """``layers`` in pp * v model chunks: Megatron's even split of the blocks, or the block
    counts ``balanced_sizes(block_indices, num_chunks)`` returns (module docstring).

    Raises:
        ConfigError: fewer blocks than chunks.
    """
    blocks = [i for i, t in enumerate(layers) if t.kind == "block"]
    n_chunks = cfg.pp * cfg.virtual_stages
    if n_chunks == 1:
        return [list(layers)]
    slots = cfg.pipeline_slots
    if len(blocks) + len(slots) < n_chunks:  # `solve.space.shape_problems` says it first
        counted = f" (+ the {'+'.join(slots)} slots)" if slots else ""
        raise ConfigError(
            f"pp={cfg.pp} x virtual_stages={cfg.virtual_stages} = {n_chunks} model chunks "
            f"but the model has {len(blocks)} repeated layers{counted} to split"
        )
    if balanced_sizes is not None and not slots:  # slots ask for Megatron's even split
        sizes = balanced_sizes(blocks, n_chunks)
    else:
        sizes = even_sizes(len(blocks), n_chunks, slots)
    ends, count = [], 0
    for size in sizes:
        count += size  # a chunk of no block (an embedding slot) ends before the first
        ends.append(blocks[count - 1] + 1 if count else blocks[0])
    ends[-1] = len(layers)  # layers after the last block ride on the last chunk
    starts = [0, *ends[:-1]]  # and those before the first block on the first
    return [list(layers[s:e]) for s, e in zip(starts, ends, strict=True)]


def even_sizes(num_blocks: int, n_chunks: int, slots: Sequence[str] = ()) -> list[int]:
    """The blocks of each chunk under Megatron's even split of ``num_blocks`` and the
    ``slots`` (`ParallelConfig.pipeline_slots`) over ``n_chunks``, the extra ones to the
    middle; the embedding's and the loss's slots hold no block."""
    base, extra = divmod(num_blocks + len(slots), n_chunks)
    middle = (n_chunks - extra) // 2
    sizes = [base + (1 if middle <= k < middle + extra else 0) for k in range(n_chunks)]
    sizes[0] -= "embedding" in slots
    sizes[-1] -= "loss" in slots
    return sizes


def chunk_weights(work: list[float], blocks: list[int]) -> list[float]:
    """Per block, its work; the layers before the first block and after the last count with
    the first and last block (embedding, head)."""
    weights = [work[i] for i in blocks]
    weights[0] += sum(work[: blocks[0]])
    weights[-1] += sum(work[blocks[-1] + 1 :])
    return weights


def recomputed_layers(cfg: ParallelConfig, chunks: Chunks) -> frozenset[str]:
    """Names of the layers cfg.recompute applies to: the first recompute_layers blocks of
    each chunk; every block for recompute_layers None (the runtime wraps blocks only, never
    the embedding, head or other layers: autopar.runtime.recompute).

    Raises:
        ConfigError: recompute_layers exceeds the blocks of the fullest chunk.
    """
    k = cfg.recompute_layers
    if k is None:
        return frozenset(t.name for c in chunks for t in c if t.kind == "block")
    return _first_blocks(cfg, chunks, k, "recompute_layers")


def offloaded_layers(cfg: ParallelConfig, chunks: Chunks) -> frozenset[str]:
    """Names of the blocks whose saved activations live in host memory: the first
    offload_layers blocks of each chunk (as the runtime wraps them: autopar.runtime.offload).

    Raises:
        ConfigError: offload_layers exceeds the blocks of the fullest chunk.
    """
    k = cfg.offload_layers
    return _first_blocks(cfg, chunks, k, "offload_layers") if k else frozenset()


def _first_blocks(cfg: ParallelConfig, chunks: Chunks, k: int, field: str) -> frozenset[str]:
    """The first ``k`` blocks of each chunk, by name; ``field`` names k in the error."""
    top = max(sum(t.kind == "block" for t in c) for c in chunks)
    if k > top:
        raise ConfigError(
            f"{field}={k} but the fullest of the {len(chunks)} model chunks "
            f"(pp={cfg.pp} x virtual_stages={cfg.virtual_stages}) holds {top} repeated layers"
        )
    return frozenset(name for c in chunks for name in [t.name for t in c if t.kind == "block"][:k])


def stage_layers(cfg: ParallelConfig, chunks: Chunks) -> Chunks:
    """The layers of each pipeline stage: its chunks' layers, in chunk order."""
    stages: Chunks = [[] for _ in range(cfg.pp)]
    for k, chunk in enumerate(chunks):
        stages[stage_of_chunk(cfg, k)].extend(chunk)
    return stages


def stage_of_chunk(cfg: ParallelConfig, k: int) -> int:
    """The stage of model chunk k: round-robin, or a V for DualPipe-V."""
    p = cfg.pp
    if cfg.schedule == "dualpipe_v":
        return k if k < p else 2 * p - 1 - k
    return k % p


def linear_partition(weights: list[float], parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous non-empty groups of ``weights`` whose largest sum is the
    smallest possible. Bisection on that largest sum with a greedy feasibility check (greedy
    filling is optimal for a given bound), then splitting groups until there are ``parts``;
    splitting never raises the maximum. O(n log(sum/eps)) instead of the O(n^2 k) table."""
    if not 1 <= parts <= len(weights):
        raise ValueError(f"cannot split {len(weights)} items into {parts} non-empty groups")

    def greedy(bound: float) -> list[list[float]]:
        groups: list[list[float]] = [[]]
        total = 0.0  # of groups[-1], added in its order as sum() would
        for w in weights:
            if groups[-1] and total + w > bound:
                groups.append([])
                total = 0.0
            groups[-1].append(w)
            total += w
        return groups

    def fits(bound: float) -> bool:
        """Whether greedy(bound) makes at most ``parts`` groups (the search's hot path)."""
        count, total, empty = 1, 0.0, True
        for w in weights:
            if not empty and total + w > bound:
                count += 1
                if count > parts:
                    return False
                total = 0.0
            total += w
            empty = False
        return True

    lo, hi = max(weights), sum(weights)
    for _ in range(60):
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    groups = greedy(hi)
    while len(groups) < parts:
        i = max((j for j, g in enumerate(groups) if len(g) > 1), key=lambda j: sum(groups[j]))
        g = groups[i]
        groups[i : i + 1] = [g[: len(g) // 2], g[len(g) // 2 :]]
    return [len(g) for g in groups]
