"""Checkpoints of a training run on torch.distributed.checkpoint (DCP): save, resume, reshard.

In: the parallelised model and its optimizer (DTensor / FSDP2 / TP shards or plain tensors),
the step just finished, `CheckpointOptions`. Out: a directory per saved step

    <directory>/step-00000004/      a complete checkpoint
        .metadata, __*.distcp       DCP: model + optimizer state by full parameter name
        meta.json                   step, samples seen, global batch, model fingerprint, plan,
                                    and every other file of the checkpoint with its size
        rng-rank<r>.pt              rank r's RNG states (torch CPU, and CUDA when present)
        extra-rank<r>.pt            rank r's state beyond model and optimizer, where the run
                                    has some (`Checkpointer.extra`: DiLoCo's outer step)
    <directory>/.partial-step-*/    being written (or left by a killed run): never resumed
    <directory>/log.jsonl           one line per finished step: loss and grad norm, exact (hex),
                                    the restart attempt and the wall-clock time

Invariants:
- A checkpoint directory exists under its final name only when complete: every rank's shards,
  the DCP metadata, the RNG files and meta.json are written into `.partial-step-N`, then rank 0
  renames it (an atomic rename on one file system). A kill at any moment leaves either the
  previous complete checkpoints or one more; resume takes the newest complete one.
- Resume verifies before it loads (`checkpoint_problem`): meta.json readable, every file
  meta.json lists present at its recorded size (a truncated or missing shard, `.metadata` or
  RNG file), every file's content its recorded SHA-256 (a flipped block, its size unchanged:
  `checkpoint_digest`), DCP's metadata readable. A damaged checkpoint is skipped with a
  message naming what is wrong, and the newest intact one resumed; none intact is a
  `CheckpointError`.
- A save that fails (a full or read-only disk) raises `CheckpointError` naming the directory,
  the bytes this rank had to write and the bytes free; its partial directory is removed, and
  the checkpoints before it stay as they were.
- The last `keep` complete checkpoints are kept; older ones are deleted after a save completes.
- Parameters a rank holds a slice of by hand, under a name every rank shares (a Hugging Face
  expert stack's experts under ep, an expert's width under etp), are plain tensors DCP would
  take for replicas and save once: their keys, and their optimizer states', carry the slice
  (`@ep1of2`, `@tp0of2`), and a checkpoint resumes only under the same expert layout (meta.json
  `expert_layout`; refused with both layouts named otherwise). meta.json `hand_slices` says
  how each was cut, so `autopar.runtime.hf_export` can join them into the whole tensor.
- Model and optimizer state go through `torch.distributed.checkpoint.state_dict.get_state_dict`
  / `set_state_dict`: keys are the original parameter names whatever the plan (FSDP2, TP,
  replicated), so a checkpoint saved under one plan loads under another (DCP reshards). A
  fused projection split piece by piece over tp is written as the plain split of its dimension
  (`fused_pieces.unstrided`), which DCP can place, and read back into its pieces.
- The data position is the step: step s's global batch depends on s alone (see
  `autopar.runtime.task`), so resuming after step s continues with batch s and recomputes no
  step before it. A checkpoint of another model (fingerprint) or another global batch size is
  refused with `CheckpointError`.
- Asynchronous saves (`async_save=True`) use `dcp.async_save` on a separate gloo group (its
  collectives run in a background thread beside the training's own); a save becomes complete
  (renamed) by rank 0 at the first step end after its save finished, at the next save, or at
  `close()`; a kill before then resumes from the one before.

Public functions:
    CheckpointOptions(directory, every=0, async_save=False, keep=2)
    CheckpointError
    Checkpointer(options, model, optimizer, *, global_batch_size, plan_text="", fingerprint="")
    open_checkpointer(options | None, model, optimizer, ...) -> Checkpointer | None
        .resume() -> int              # steps already done (0: start from scratch)
        .after_step(step, loss, grad_norm)   # log; save when step % every == 0
        .close()                      # finish a pending asynchronous save
    latest_checkpoint(directory) -> Path | None
    checkpoint_problem(path) -> str | None   # what is damaged, None when intact
    read_meta(path) -> dict
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from autopar.errors import AutoparError
from autopar.estimate.goodput import goodput_interval
from autopar.models.source import model_fingerprint
from autopar.runtime.checkpoint_digest import collect as collect_digests
from autopar.runtime.checkpoint_digest import problem as digest_problem
from autopar.runtime.checkpoint_digest import write_rank_digests
from autopar.runtime.fused_pieces import restrided, unstrided
from autopar.runtime.startup.regions import HandSlice

FORMAT_VERSION = 1
_FINAL = re.compile(r"^step-(\d{8})$")


class CheckpointError(AutoparError, RuntimeError):
    """A checkpoint that cannot be resumed here: another model, another batch, a bad file."""


@dataclass(frozen=True)
class CheckpointOptions:
    """Where and how often to checkpoint.

    directory: the run's checkpoint directory (shared by all ranks; a shared file system when
        the ranks are on several nodes). every: save after every this many steps (0: never
        save, only resume). async_save: `dcp.async_save` instead of a blocking save. keep:
        complete checkpoints kept (the newest). resume: start from the newest complete one.
    """

    directory: str
    every: int = 0
    async_save: bool = False
    keep: int = 2
    resume: bool = True

    def __post_init__(self) -> None:
        if self.every < 0 or self.keep < 1:
            raise ValueError(f"checkpoint every={self.every} must be >= 0, keep={self.keep} >= 1")


# Optimizer state keyed per parameter ("optimizer.state.<fqn>.exp_avg", ".param_groups.<fqn>.lr"):
# the default keeps param_groups as one list under one key, which DCP saves once (rank 0's),
# so a rank of another pipeline stage would load groups naming none of its parameters.
_SD_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _name(step: int) -> str:
    return f"step-{step:08d}"


def complete_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints in ``directory``, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _FINAL.match(path.name)
        if match and (path / "meta.json").is_file() and (path / ".metadata").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint in ``directory`` (None when there is none)."""
    found = complete_checkpoints(directory)
    return found[-1][1] if found else None


def read_meta(path: str | Path) -> dict[str, Any]:
    """A checkpoint's meta.json (CheckpointError names the file when it cannot be read)."""
    file = Path(path) / "meta.json"
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read checkpoint metadata {file}: {e}") from None
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"{file} has checkpoint format {meta.get('format')!r}; this autopar reads "
            f"format {FORMAT_VERSION}"
        )
    return meta


def checkpoint_problem(path: str | Path) -> str | None:
    """What is wrong with the complete checkpoint at ``path`` (module docstring), or None."""
    path = Path(path)
    try:
        meta = read_meta(path)
    except CheckpointError as e:
        return str(e)
    files = meta.get("files")
    if files is None:  # saved before autopar recorded its files: the RNG files and metadata
        files = {f"rng-rank{r}.pt": None for r in range(int(meta.get("world_size", 1)))}
    for name, size in sorted(files.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if size is not None and file.stat().st_size != size:
            return f"{name} holds {file.stat().st_size:,} bytes, but {size:,} were written"
    changed = digest_problem(path, meta.get("sha256") or {})
    if changed is not None:
        return changed
    try:
        dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 -- any unpickling or I/O error means: unreadable
        return f".metadata cannot be read ({type(e).__name__}: {e})"
    return None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _tagged(
    state: dict[str, dict[str, Any]], sliced: Mapping[str, str]
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, str]]]:
    """``state`` ({"model", "optimizer"}, the optimizer's flattened as "state.<name>.<stat>"
    and "param_groups.<name>.<key>") with each sliced parameter's keys suffixed by its slice,
    and per part the tagged key -> the original."""
    out: dict[str, dict[str, Any]] = {}
    names: dict[str, dict[str, str]] = {}
    for part, sd in state.items():
        out[part], names[part] = {}, {}
        for key, value in sd.items():
            new = key
            if part == "model":
                new = key + sliced.get(key, "")
            elif sliced:
                head, _, rest = key.partition(".")
                name, _, leaf = rest.rpartition(".")
                if name in sliced:
                    new = f"{head}.{name}{sliced[name]}.{leaf}"
            out[part][new] = value
            names[part][new] = key
    return out, names


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


class Checkpointer:
    """Saves and resumes one run's model, optimizer, step, data position and RNG states.

    Every method is collective: call it on every rank at the same point of the loop.
    """

    def __init__(
        self,
        options: CheckpointOptions,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        global_batch_size: int,
        plan_text: str = "",
        fingerprint: str = "",
        sliced: Mapping[str, str] | None = None,
        expert_layout: str = "",
        hand_slices: Mapping[str, Sequence[HandSlice]] | None = None,
    ) -> None:
        self.options = options
        # how each sliced parameter was cut (rank-free), for joining it again (`hf_export`)
        self.cuts = {
            name: [[c.dim, c.pieces, c.num] for c in cuts]
            for name, cuts in (hand_slices or {}).items()
        }
        # parameter name -> the slice this rank holds of it by hand (module docstring)
        self.sliced = dict(sliced or {})
        self.expert_layout = expert_layout
        self.model = model
        self.optimizer = optimizer
        self.global_batch_size = global_batch_size
        self.plan_text = plan_text
        self.root = Path(options.directory)
        # the whole model's: under pp > 1 ``model`` is this rank's chunks, so the caller passes
        # the plan's (checked against the built model); DTensors report their global shapes
        self.fingerprint = fingerprint or model_fingerprint(model)
        self.rank = _rank()
        self._pending: tuple[int, Future, int] | None = None  # step, future, bytes written
        # this rank's state beyond the model and optimizer: a function of no arguments the run
        # sets (`replicas.ReplicaRun`: DiLoCo's outer state), saved as extra-rank<r>.pt; and
        # what `resume` read of it (None: the checkpoint has none for this rank)
        self.extra: Callable[[], dict[str, Any]] | None = None
        self.resumed_extra: dict[str, Any] | None = None
        # async: DCP's collectives run in a thread, so they get a group of their own; it
        # keeps torch's 30-minute timeout, not the job's (`mesh.collective_timeout`): its
        # last barrier waits for every rank's writes, which a large model's take minutes
        self._group = dist.new_group(backend="gloo") if options.async_save else None

    # ----------------------------------------------------------------- resume
    def resume(self) -> int:
        """Load the newest complete checkpoint, if any; returns the steps already done.

        Also deletes `.partial-*` directories a killed run left behind.

        Raises:
            CheckpointError: the checkpoint is of another model or global batch size.
        """
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".partial-step-*"):
                shutil.rmtree(stale, ignore_errors=True)
        _barrier()
        path = self._intact() if self.options.resume else None
        if path is None:
            return 0
        meta = read_meta(path)
        self._check(meta, path)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_SD_OPTIONS)
        tagged, names = _tagged({"model": model_sd, "optimizer": optim_sd}, self.sliced)
        tagged, strided = unstrided(tagged)
        try:
            dcp.load(tagged, checkpoint_id=str(path))
        except (Exception, CheckpointException) as e:  # a rank's read error, on every rank
            raise CheckpointError(f"checkpoint {path} could not be loaded: {_cause(e)}") from None
        for (part, key), original in strided.items():  # back to the pieces' split
            tagged[part][key] = restrided(tagged[part][key], original)
        # back to the parameters' own names (DCP replaced the non-tensor values it read)
        state = {part: {names[part][k]: v for k, v in sd.items()} for part, sd in tagged.items()}
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
            options=_SD_OPTIONS,
        )
        rng = path / f"rng-rank{self.rank}.pt"
        # a rank the saving run did not have keeps its seeded state (a run resumed on more
        # ranks); the saving run's own ranks' files were verified present
        if self.rank < int(meta.get("world_size", 1)):
            saved = torch.load(rng, weights_only=True)
            torch.set_rng_state(saved["cpu"])
            if "cuda" in saved and torch.cuda.is_available():
                torch.cuda.set_rng_state(saved["cuda"])
        extra = path / f"extra-rank{self.rank}.pt"
        self.resumed_extra = torch.load(extra, weights_only=True) if extra.is_file() else None
        if self.rank == 0:
            print(
                f"[autopar] resumed from {path} (step {meta['step']}, "
                f"{meta['samples_seen']} samples seen, saved under {meta['plan']})",
                flush=True,
            )
        return int(meta["step"])

    def _intact(self) -> Path | None:
        """The newest checkpoint that verifies (rank 0 decides, every rank gets its answer);
        the damaged newer ones are named on rank 0's output."""
        chosen: list[Any] = [None]
        if self.rank == 0:
            damaged = []
            for _, path in reversed(complete_checkpoints(self.root)):
                problem = checkpoint_problem(path)
                if problem is None:
                    chosen[0] = str(path)
                    break
                damaged.append(f"{path.name}: {problem}")
                print(f"[autopar] checkpoint {path} is damaged ({problem}): skipped", flush=True)
            if damaged and chosen[0] is None:
                chosen[0] = "damaged:" + "; ".join(damaged)
        if dist.is_initialized():
            dist.broadcast_object_list(chosen, src=0)
        if chosen[0] is not None and chosen[0].startswith("damaged:"):
            raise CheckpointError(
                f"no intact checkpoint in {self.root} to resume from ({chosen[0][8:]}): move "
                "them aside to start over, or repair them"
            )
        return None if chosen[0] is None else Path(chosen[0])

    def _check(self, meta: dict[str, Any], path: Path) -> None:
        if meta["model_fingerprint"] != self.fingerprint:
            raise CheckpointError(
                f"checkpoint {path} holds a model with fingerprint {meta['model_fingerprint']} "
                f"but this program trains one with fingerprint {self.fingerprint} (other "
                "parameter names or shapes): use another --checkpoint-dir"
            )
        saved = meta.get("expert_layout", "")
        if saved != self.expert_layout:
            raise CheckpointError(
                f"checkpoint {path} holds experts sliced by hand as {saved or 'none'}, this run "
                f"as {self.expert_layout or 'none'}: resume under the same ep and etp (autopar "
                "does not re-slice Hugging Face expert stacks or experts split over tp)"
            )
        if meta["global_batch_size"] != self.global_batch_size:
            raise CheckpointError(
                f"checkpoint {path} was trained with global batch {meta['global_batch_size']} "
                f"but this run's is {self.global_batch_size}: the data position "
                f"({meta['samples_seen']} samples) would not be a whole step; keep the batch"
            )

    # ------------------------------------------------------------------- save
    def after_step(self, step: int, loss: float, grad_norm: float) -> None:
        """Record step ``step`` (1-based, finished) in log.jsonl; save when it is due."""
        self._finish_pending(wait=False)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            line = {
                "step": step,
                "loss": float(loss).hex(),
                "grad_norm": float(grad_norm).hex(),
                "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                "time": time.time(),  # wall clock at the step's end (goodput is measured so)
            }
            with open(self.root / "log.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
        if self.options.every and step % self.options.every == 0:
            self.save(step)

    def save(self, step: int) -> None:
        """Checkpoint the state after ``step`` steps (blocking, or started asynchronously).

        Every rank writes its RNG file before DCP's first collective, and DCP's coordinator
        (rank 0) returns only after every rank's shards are written and it wrote `.metadata`;
        so rank 0 alone completes the checkpoint (meta.json, rename, prune) once its own save
        is done, with no further collective.
        """
        self._finish_pending(wait=True)
        partial = self.root / f".partial-{_name(step)}"
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_SD_OPTIONS)
        state, _ = _tagged({"model": model_sd, "optimizer": optim_sd}, self.sliced)
        state, _ = unstrided(state)
        error = None
        rng = partial / f"rng-rank{self.rank}.pt"
        try:
            partial.mkdir(parents=True, exist_ok=True)
            torch.save(_rng_state(), rng)
            if self.extra is not None:
                torch.save(self.extra(), partial / f"extra-rank{self.rank}.pt")
        except (OSError, RuntimeError) as e:  # torch's zip writer reports a short write so
            error = OSError(f"writing {rng.name} or extra-rank{self.rank}.pt: {_cause(e)}")
        # every rank enters DCP's collectives, or none does: a rank that could not write its
        # own file must not leave the others waiting in them
        errors = [error]
        if dist.is_initialized():
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            self._failed(step, failed, state)
        try:
            if self.options.async_save:
                # the state is staged (copied) before async_save returns: training may go on
                future = dcp.async_save(
                    state, checkpoint_id=str(partial), process_group=self._group
                )
                rank = self.rank
                future.add_done_callback(lambda f: f.exception() or write_rank_digests(
                    partial, rank))  # fmt: skip
                self._pending = (step, future, _bytes_of(state))  # type: ignore[assignment]
                return
            dcp.save(state, checkpoint_id=str(partial))
            write_rank_digests(partial, self.rank)
        except (Exception, CheckpointException) as e:  # any rank's write error, on every rank
            self._failed(step, e, state)
        self._complete(step)

    def _failed(self, step: int, error: BaseException, state: Any) -> None:
        """Remove the partial checkpoint and raise CheckpointError with the numbers."""
        partial = self.root / f".partial-{_name(step)}"
        if self.rank == 0:  # every rank's writes have ended: DCP failed them all together
            shutil.rmtree(partial, ignore_errors=True)
        need = state if isinstance(state, int) else _bytes_of(state)
        try:
            free = f"{shutil.disk_usage(self.root).free:,} bytes free there"
        except OSError:
            free = "its free space unknown"
        kept = complete_checkpoints(self.root)
        before = f"the checkpoint of step {kept[-1][0]} is intact" if kept else "none before it"
        raise CheckpointError(
            f"saving the checkpoint of step {step} into {self.root} failed: {_cause(error)} "
            f"(rank {self.rank} writes {need:,} bytes; {free}); {before}"
        ) from None

    def close(self) -> None:
        """Complete a pending asynchronous save (call once on every rank after the last step)."""
        self._finish_pending(wait=True)
        _barrier()  # on return every checkpoint of the run is complete, on every rank

    def _finish_pending(self, *, wait: bool) -> None:
        if self._pending is None:
            return
        step, future, need = self._pending
        if not wait and not future.done():
            return
        self._pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as e:  # the background save's write error
            self._failed(step, e, need)
        self._complete(step)

    def _complete(self, step: int) -> None:
        """Rank 0: add meta.json, rename the partial directory to its final name, prune."""
        if self.rank != 0:
            return
        partial = self.root / f".partial-{_name(step)}"
        world = dist.get_world_size() if dist.is_initialized() else 1
        digests = collect_digests(partial, world)  # every rank's, as it wrote its files
        files = {p.name: p.stat().st_size for p in partial.iterdir() if p.is_file()}
        meta = {
            "format": FORMAT_VERSION,
            "step": step,
            "samples_seen": step * self.global_batch_size,
            "global_batch_size": self.global_batch_size,
            "model_fingerprint": self.fingerprint,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "plan": self.plan_text,
            "expert_layout": self.expert_layout,
            "hand_slices": self.cuts,
            "files": files,  # every shard, .metadata and RNG file: resume checks them
            "sha256": digests,  # and their content (`checkpoint_digest.problem`)
        }
        final = self.root / _name(step)
        try:
            (partial / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
            if final.exists():  # the same step saved again (a resumed run that re-saved it)
                shutil.rmtree(final)
            partial.rename(final)
        except OSError as e:
            self._failed(step, e, sum(files.values()))
        for _, old in complete_checkpoints(self.root)[: -self.options.keep]:
            shutil.rmtree(old, ignore_errors=True)


def _cause(error: BaseException) -> str:
    """One line per failing rank for DCP's exception (its text holds every traceback)."""
    if isinstance(error, CheckpointException):
        return "; ".join(
            f"rank {rank}: {type(exc).__name__}: {exc}"
            for rank, (exc, _) in sorted(error.failures.items())
        )
    text = f"{type(error).__name__}: {error}"
    if "unexpected pos" in text:  # how torch.save's zip writer reports a short write
        text += " (a short write: the disk is full or the file too large)"
    return text


def checkpoint_interval(text: str, async_save: bool, goodput: Mapping[str, float]) -> int:
    """``--checkpoint-every``: a whole number of steps, or ``auto``: the plan's best interval
    for the save mode (`autopar.estimate.goodput`; 100 where the plan priced no failures).

    Raises:
        ValueError: neither a count >= 0 nor auto.
    """
    if text == "auto":
        return goodput_interval(dict(goodput or {}), async_save) or 100
    if not text.isdigit():
        raise ValueError(f"--checkpoint-every takes a step count or auto, got {text!r}")
    return int(text)


def _bytes_of(state: Any) -> int:
    """Bytes of the tensors in a (nested) state dict on this rank (a DTensor's local shard)."""
    if isinstance(state, dict):
        return sum(_bytes_of(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(_bytes_of(v) for v in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


def open_checkpointer(
    options: CheckpointOptions | None,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    global_batch_size: int,
    plan_text: str = "",
    fingerprint: str = "",
    sliced: Mapping[str, str] | None = None,
    expert_layout: str = "",
    hand_slices: Mapping[str, Sequence[HandSlice]] | None = None,
) -> Checkpointer | None:
    """A `Checkpointer` when ``options`` asks for one, else None (the trainer's hook).
    ``sliced``: parameter name -> the slice this rank holds of it by hand; ``expert_layout``:
    how, for meta.json (module docstring)."""
    if options is None:
        return None
    return Checkpointer(
        options,
        model,
        optimizer,
        global_batch_size=global_batch_size,
        plan_text=plan_text,
        fingerprint=fingerprint,
        sliced=sliced,
        expert_layout=expert_layout,
        hand_slices=hand_slices,
    )
