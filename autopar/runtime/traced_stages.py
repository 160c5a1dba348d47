"""Pipeline chunks cut from the traced graph: any model whose blocks sit in one list.

In: a model `autopar.runtime.parts` has no entry for, how the task calls it (`Task.forward`),
one micro-batch of its inputs, and a `ChunkLayout`. Out: this rank's chunks, each a graph
module torch.distributed.pipelining cut from `torch.export` of the forward at the blocks'
boundaries (`pipeline(..., split_spec={"<blocks>.k": SplitPoint.BEGINNING})`), marked with
what `autopar.runtime.pipeline` reads of a chunk (`chunk`, `is_first`, `is_last`,
`tied_copies`, `named_blocks()`).

Why torch's tracer frontend rather than a table of model classes: the graph, not the class,
says what one stage hands the next (GPT-2's hidden states and its attention mask, whatever a
user's model computes before its first block). Three things it leaves to its own (traced)
stage runtime that our manual `PipelineStage`s need done here: a value a later stage reads is
carried through the stages in between (`_routes`: torch's stages hand their outputs to the next
stage only); a `no_grad` region that reads no parameter is inlined before the cut
(`_inline_grad_regions`: export wraps it in a higher-order op, whose body torch's outliner
places so that the module running it -- Hugging Face's rotary embedding -- comes back as two
calls, the first without inputs); outputs are sent contiguous, not as views. The cut is
`pipeline(root, example, split_spec=...)` spelled out (`annotate_split_points`, then
`Pipe.from_tracing` with the inlining as its split policy), because `pipeline` takes a split
spec or a policy, not both.

What a traced chunk holds: the model's submodules under their original paths, each an
`InterpreterModule` of aten ops (not an `nn.Linear`), so parameter names -- and checkpoints --
are the model's own. Data parallelism, FSDP (ZeRO 1-3) and recomputation apply to them as to
any module; tensor, sequence, context and expert parallelism, which replace or rewire
`nn.Linear` / attention modules, do not: `autopar.runtime.capability` offers traced pipelines
with tp = cp = ep = 1 only.

Shared parameters. torch copies a parameter that several stages read into each. A tie between
the first and the last chunk (GPT-2's head is its token embedding) is what the pipeline already
sums after backward (`Pipeline.sync_tied_gradients`); any other sharing across chunks is
refused with the parameter's names. A parameter a chunk holds but never reads (torch leaves the
head's alias of the embedding on the first chunk) is dropped from it.

The trace is static in shape: the micro-batch given is the one every step runs.

Public functions:
    block_lists(model) -> [(path, number of blocks)]
    traced_blocks(model) -> (blocks path, number of blocks) | None   # when exactly one list
    require_blocks(model) -> (blocks path, number of blocks)          # or ValueError, why not
    why_no_block_list(model) -> str
    traced_chunks(model, forward, example, layout, pp_rank) -> (chunks, tied pairs)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopar.runtime.stages import ChunkLayout

Forward = Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]


def block_lists(model: nn.Module) -> list[tuple[str, int]]:
    """Every list of repeated blocks in ``model`` (path, length): an `nn.ModuleList` of two
    or more modules of one class, each holding parameters, not inside another such list."""
    found: list[tuple[str, int]] = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2 or not path:
            continue
        if any(path.startswith(p + ".") for p, _ in found):
            continue
        kinds = {type(m) for m in module}
        if len(kinds) == 1 and all(next(m.parameters(), None) is not None for m in module):
            found.append((path, len(module)))
    return found


def traced_blocks(model: nn.Module) -> tuple[str, int] | None:
    """The list of repeated blocks a traced pipeline cuts between (its path and length), or
    None when the model has no such list, or several (an encoder and a decoder: which blocks
    a stage holds would not follow from one index)."""
    found = block_lists(model)
    return found[0] if len(found) == 1 else None


def require_blocks(model: nn.Module) -> tuple[str, int]:
    """`traced_blocks`, or ValueError saying why ``model`` has no list to cut between."""
    found = block_lists(model)
    if len(found) != 1:
        raise ValueError(
            f"autopar cannot cut {type(model).__name__} into pipeline stages: " + _why(found)
        )
    return found[0]


def why_no_block_list(model: nn.Module) -> str:
    """Why ``model`` has no one list of blocks to cut between (`traced_blocks` is None)."""
    return _why(block_lists(model))


def _why(found: list[tuple[str, int]]) -> str:
    if not found:
        return "it has no nn.ModuleList of repeated blocks"
    lists = ", ".join(f"{path} ({n})" for path, n in found)
    return f"its repeated blocks are in {len(found)} lists ({lists}), not one"


class _Root(nn.Module):
    """The model's children under their own names, called as the task calls the model: the
    traced root whose submodule paths (and so the chunks' parameter names) are the model's."""

    def __init__(self, model: nn.Module, forward: Forward) -> None:
        super().__init__()
        self._modules = model._modules
        self._parameters = model._parameters
        self._buffers = model._buffers
        object.__setattr__(self, "_model", model)  # not a child: its children are ours
        object.__setattr__(self, "_forward", forward)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self._forward(self._model, inputs)


@dataclass(frozen=True)
class _Route:
    """How a chunk sits between its cuts: ``take[i]`` is which carried value is its graph's
    i-th input; ``give`` lists what it passes on, ("in", i) a carried value handed through,
    ("out", j) its graph's j-th output (j = -1: the output itself, not a tuple)."""

    take: tuple[int, ...]
    give: tuple[tuple[str, int], ...]


def _routes(split: torch.fx.GraphModule) -> list[_Route]:
    """Each stage's `_Route`, from the graph torch cut the model into (its top level calls the
    stages in turn). torch.distributed.pipelining's stages hand their outputs to the next stage
    only, so a value a later stage reads (GPT-2's attention mask, made before block 0 and read
    by every block) is carried through the stages in between."""
    nodes = list(split.graph.nodes)
    calls = [n for n in nodes if n.op == "call_module"]
    stage_of = {call: k for k, call in enumerate(calls)}
    order = {n: i for i, n in enumerate(nodes)}

    def made_by(v: torch.fx.Node) -> int:
        if v.op == "placeholder":
            return -1
        return stage_of[v] if v in stage_of else stage_of[v.args[0]]  # getitem(stage, j)

    def source(v: torch.fx.Node) -> tuple[str, int]:
        return ("out", -1) if v in stage_of else ("out", int(v.args[1]))

    (output,) = (n for n in nodes if n.op == "output")
    final = _nodes_in(output.args)
    reads = [_nodes_in(call.args) for call in calls] + [final]
    carried = [n for n in nodes if n.op == "placeholder"]
    routes = []
    for k in range(len(calls)):
        later = {v for needs in reads[k + 1 :] for v in needs if made_by(v) <= k}
        passed = sorted(later, key=order.__getitem__) if k < len(calls) - 1 else final
        give = [("in", carried.index(v)) if v in carried else source(v) for v in passed]
        routes.append(_Route(tuple(carried.index(v) for v in reads[k]), tuple(give)))
        carried = list(passed)
    return routes


def _item(out: Any, j: int) -> Any:
    return out if j == -1 else out[j]


class TracedChunk:
    """Mixed into a traced stage module's class: what `autopar.runtime.pipeline` reads of a
    chunk (`autopar.runtime.stages.StageModule` has the same)."""

    chunk: int
    num_chunks: int
    is_first: bool
    is_last: bool
    blocks_path: str
    tied_copies: dict[str, str]
    route: _Route

    def forward(self, *carried: torch.Tensor) -> Any:
        """The values live across the previous cut (the model's inputs on the first chunk)
        -> those live across the next (the model's output on the last)."""
        out = super().forward(*(carried[i] for i in self.route.take))  # type: ignore[misc]
        given = [carried[i] if kind == "in" else _item(out, i) for kind, i in self.route.give]
        # torch sizes the next stage's receive buffers from these outputs' layout, and gloo
        # receives into contiguous tensors only; a view (the graph's final alias) would also
        # sit under FSDP's output hook, which in-place use could bypass: send fresh tensors
        given = [_fresh(t) if isinstance(t, torch.Tensor) else t for t in given]
        return given[0] if len(given) == 1 else tuple(given)

    def named_blocks(self) -> list[tuple[str, nn.Module]]:
        """(original path, block) of this chunk's blocks."""
        held = self.get_submodule(self.blocks_path)  # type: ignore[attr-defined]
        return [(f"{self.blocks_path}.{k}", m) for k, m in held.named_children() if k.isdigit()]


def _inline_grad_regions(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A split policy (applied to the traced graph before it is cut): each `torch.no_grad`
    region export wrapped in a higher-order op (`wrap_with_set_grad_enabled`) inlined, where
    nothing it reads depends on a parameter -- there no gradient could flow, so running it with
    gradients enabled computes the same values and the same (absent) gradients.

    Why: torch rebuilds each stage's module tree from the module frames of consecutive nodes,
    and puts the region's body (a `get_attr` of a graph module) at the top of the stage; the
    module that ran the region (Hugging Face's rotary embedding, under no_grad) then comes back
    as two calls, the first without its inputs, and the stage fails to run. Inlined, the
    region's nodes are the module's own, in order. A region reading parameters stays wrapped."""
    wrap = torch.ops.higher_order.wrap_with_set_grad_enabled
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not wrap:
            continue
        enabled, body_node, *args = node.args
        body = gm.get_submodule(str(body_node.target))
        if (
            enabled
            or _reads_parameters(gm, args)
            or any(n.op == "get_attr" for n in body.graph.nodes)
        ):
            continue
        stack = node.meta.get("nn_module_stack")
        env: dict[torch.fx.Node, Any] = {}
        inputs = iter(args)
        with graph.inserting_before(node):
            for inner in body.graph.nodes:
                if inner.op == "placeholder":
                    env[inner] = next(inputs)
                elif inner.op == "output":
                    outputs = torch.fx.map_arg(inner.args[0], env.__getitem__)
                else:
                    env[inner] = copied = graph.node_copy(inner, env.__getitem__)
                    copied.meta = {**inner.meta, "nn_module_stack": stack}
        for user in list(node.users):  # getitem(region, i) -> the body's i-th output
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
        graph.erase_node(node)
        if not body_node.users:
            graph.erase_node(body_node)
    graph.lint()
    gm.recompile()
    return gm


def _reads_parameters(gm: torch.fx.GraphModule, args: Any) -> bool:
    """Whether any node in ``args`` is computed from a parameter of ``gm``."""
    params = {name for name, _ in gm.named_parameters()}
    seen: set[torch.fx.Node] = set()
    todo = _nodes_in(args)
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "get_attr" and str(node.target) in params:
            return True
        todo.extend(node.all_input_nodes)
    return False


def _nodes_in(args: Any) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(args, lambda n: found.append(n) or n)
    return found


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and not a view of another tensor."""
    return t.clone(memory_format=torch.contiguous_format) if t._base is not None else t.contiguous()


def _used_parameters(module: nn.Module, prefix: str = "") -> set[str]:
    """Paths of the parameters ``module``'s graph (and the graphs it calls) reads."""
    graph = getattr(module, "graph", None)
    if not isinstance(graph, torch.fx.Graph):  # a module torch kept whole
        return {prefix + name for name, _ in module.named_parameters()}
    used: set[str] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            used.add(prefix + str(node.target))
        elif node.op == "call_module":
            child = module.get_submodule(str(node.target))
            used |= _used_parameters(child, f"{prefix}{node.target}.")
    return used


def _drop_unused(stage: nn.Module) -> set[str]:
    """Remove the parameters ``stage`` holds but never reads; the names it keeps."""
    used = _used_parameters(stage)
    for name, _ in list(stage.named_parameters(remove_duplicate=False)):
        if name not in used:
            owner, _, leaf = name.rpartition(".")
            stage.get_submodule(owner)._parameters.pop(leaf, None)
    return {name for name, _ in stage.named_parameters()}


def _ties(model: nn.Module, held: list[set[str]]) -> tuple[tuple[str, str], ...]:
    """(last-chunk name, first-chunk name) of each parameter of ``model`` read by several
    chunks (``held``: the names each chunk keeps), refusing any sharing but first-last."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    last = len(held) - 1
    out = []
    for aliases in names.values():
        where = [(k, n) for k, chunk in enumerate(held) for n in aliases if n in chunk]
        chunks = sorted({k for k, _ in where})
        if len(chunks) < 2:
            continue
        if chunks != [0, last] or len(where) != 2:
            said = ", ".join(f"{n} on chunk {k}" for k, n in where)
            raise ValueError(
                f"a parameter is read by several pipeline chunks ({said}): autopar sums a "
                "shared weight's gradients only between the first and the last chunk (a tied "
                "embedding); use fewer pipeline stages or untie it"
            )
        first = next(n for k, n in where if k == 0)
        out.append((next(n for k, n in where if k == last), first))
    return tuple(out)


# the traced cut marks a chunk's start at a block; a last chunk of no block starts at the
# head, a module the trace does not name
NO_LOSS_SLOT = (
    "a loss slot (pipeline_slots with 'loss': the head in a chunk of its own) needs a "
    "ModelParts entry (autopar.runtime.parts) to find {name}'s head; its traced cut starts "
    "chunks at blocks only (the embedding slot is fine)"
)


def traced_chunks(
    model: nn.Module,
    forward: Forward,
    example: tuple[torch.Tensor, ...],
    layout: ChunkLayout,
    pp_rank: int,
    device: torch.device | None = None,
) -> tuple[list[nn.Module], tuple[tuple[str, str], ...]]:
    """This pp rank's chunks of ``model`` cut from its traced graph, and the tied parameter
    pairs (last-chunk name, first-chunk name) the pipeline sums (see the module docstring).

    Every rank traces the whole model (the same graph everywhere) and keeps its own chunks.
    ``device``: where the chunks will run, when the trace ran elsewhere (on the meta device,
    before the rank's shards are made): the tensors the graph makes (a mask's `arange`) are
    made there, not where the example was (`_retarget`).

    Raises:
        ValueError: no list of blocks, the trace does not cut into the layout's chunks (the
            blocks are not called in order), or a parameter is shared otherwise than first-last.
    """
    from torch.distributed.pipelining import SplitPoint
    from torch.distributed.pipelining._IR import Pipe, annotate_split_points

    path, num_blocks = require_blocks(model)
    if layout.num_blocks != num_blocks:
        raise ValueError(f"the layout cuts {layout.num_blocks} blocks, the model has {num_blocks}")
    if layout.bounds[-1][0] == layout.bounds[-1][1]:
        raise ValueError(NO_LOSS_SLOT.format(name=type(model).__name__))
    spec = {f"{path}.{a}": SplitPoint.BEGINNING for a, _ in layout.bounds[1:]}
    root = _Root(model, forward)
    annotate_split_points(root, spec)  # each chunk's first block marks a cut when traced
    try:
        # `pipeline(root, example, split_spec=spec)`, with grad-mode regions inlined
        # (`_inline_grad_regions`)
        pipe = Pipe.from_tracing(root, example, split_policy=_inline_grad_regions)
    except Exception as e:  # export's own failure, with its reason
        raise ValueError(
            f"torch.export could not trace {type(model).__name__} to cut it into pipeline "
            f"stages: {str(e).splitlines()[0]}"
        ) from e
    if pipe.num_stages != layout.num_chunks:
        raise ValueError(
            f"cutting {type(model).__name__} before blocks {sorted(spec)} gave "
            f"{pipe.num_stages} stages, not {layout.num_chunks}: its forward does not call "
            f"{path} in order"
        )
    stages = [pipe.get_stage_module(k) for k in range(layout.num_chunks)]
    held = [_drop_unused(stage) for stage in stages]
    tied = _ties(model, held)
    routes = _routes(pipe.split_gm)
    chunks = []
    for k in layout.chunks_on(pp_rank):
        if device is not None:
            _retarget(stages[k], example[0].device, device)
        chunks.append(_mark(stages[k], k, layout.num_chunks, path, tied, routes[k]))
    return chunks, tied


def _retarget(stage: nn.Module, traced: torch.device, device: torch.device) -> None:
    """Make the tensors ``stage``'s graphs create or move on ``device``: export writes the
    example's device into each factory call (`arange(16, device=meta)`) and each move to the
    input's device (`to(inv_freq, meta)`)."""
    if traced == device:
        return
    for module in stage.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        changed = False
        for node in graph.nodes:
            if node.kwargs.get("device") == traced:
                node.update_kwarg("device", device)
                changed = True
            if traced in node.args:  # `to(x, meta)`: a rotary table moved to x.device
                node.args = tuple(device if a == traced else a for a in node.args)
                changed = True
            if node.target is torch.ops.aten.histc.default and device.type in ("cpu", "mps"):
                # transformers counts tokens per expert by histc on ints off the CPU (its
                # branch on the device the trace saw), which the CPU kernel does not take
                with graph.inserting_before(node):
                    floats = graph.call_function(
                        torch.ops.aten._to_copy.default, (node.args[0],), {"dtype": torch.float32}
                    )
                node.args = (floats, *node.args[1:])
                changed = True
        if changed and hasattr(module, "recompile"):
            module.recompile()


def _mark(
    stage: nn.Module,
    k: int,
    n: int,
    blocks_path: str,
    tied: tuple[tuple[str, str], ...],
    route: _Route,
) -> nn.Module:
    """``stage`` as a `TracedChunk` (its class extended, as torch itself does per graph)."""
    stage.__class__ = type("TracedChunk", (TracedChunk, type(stage)), {})
    chunk: Any = stage
    chunk.chunk, chunk.num_chunks = k, n
    chunk.is_first, chunk.is_last = k == 0, k == n - 1
    chunk.blocks_path = blocks_path
    chunk.tied_copies = dict(tied) if chunk.is_last and not chunk.is_first else {}
    chunk.route = route
    return stage
