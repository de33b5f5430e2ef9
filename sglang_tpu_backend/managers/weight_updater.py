"""Weight updates without a restart (``/update_weights_from_disk``,
``/update_weights_from_tensor``).

The new checkpoint (or the named tensors, ``model_executor/tensor_update.py``) is loaded on
the host, checked against the serving params and placed like them while the old weights keep
serving. Then new requests are held (at most
``--max-queued-requests``; more get HTTP 503), the requests already in the engine finish on
the old weights for at most ``--weight-update-timeout`` seconds (then they are aborted with a
message saying so; ``abort_all_requests`` aborts them at once), and with no step in flight and
the pools idle (or generation paused: ``rl_control.py``) the loop swaps the params (same
shapes, shardings and layouts: nothing recompiles), flushes the prefix cache (its pages and
snapshots came from the old weights; a tensor update with ``flush_cache=False`` keeps it),
sets the weight version (also in every output's meta_info) and releases the held requests
onto the new weights. Under NEXTN the MTP layers' params are loaded, checked and swapped with
them (a checkpoint without ``mtp.*`` is refused; a tensor update without ``mtp.*`` keeps the
MTP params); the MTP KV cache needs no flush: with the pools idle no request holds pages, and
a step reads MTP KV only at positions its own request's steps wrote (``nextn_step.py``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any, Callable

import jax

from sglang_tpu_backend.config import DTYPES
from sglang_tpu_backend.managers.io_struct import ServiceUnavailableError
from sglang_tpu_backend.managers.schedule_batch import Req
from sglang_tpu_backend.model_executor import weight_update

logger = logging.getLogger(__name__)
_REBALANCED = ("the serving params changed while the update was built (an EPLB rebalance); "
               "retry")


class WeightUpdater:
    """One engine's weight version, pending swap and held requests.

    Args:
      loop: the engine's ``SchedulerLoop`` (lock, scheduler, delivery).
      runner: ``ModelRunner`` (param spec, placement, ``replace_params``).
      model_config: the served model's config (an update must match it).
      args: the engine's ServerArgs (dtype, nnodes, queue bound, timeout, weight_version).
    """

    def __init__(self, loop: Any, runner: Any, model_config: Any, args: Any):
        self.loop, self.runner, self.model_config, self.args = loop, runner, model_config, args
        self.version = args.weight_version
        self.pending: weight_update.PendingSwap | None = None  # waiting for the loop
        self.held: list[tuple[Req, Callable[[], None]]] = []  # requests held during a swap
        self._serialize = threading.Lock()  # one update at a time

    @property
    def updates_lock(self) -> threading.Lock:
        """Held by an update from its first read of the serving params to its answer (memory
        release takes it too, so it never frees params an update is reading)."""
        return self._serialize

    @property
    def has_pending(self) -> bool:
        return self.pending is not None

    # Requests arriving during an update -------------------------------------------------------
    def submit(self, req: Req, submit: Callable[[], None]) -> None:
        """``submit()`` a new request now, or hold it until the pending swap is done (it then
        runs on the new weights). Lock held. ServiceUnavailableError when the held requests
        reach ``--max-queued-requests``."""
        if self.pending is None:
            submit()
            return
        limit = self.args.max_queued_requests
        if limit is not None and len(self.held) >= limit:
            raise ServiceUnavailableError(
                f"{len(self.held)} requests are already held for a weight update "
                f"(--max-queued-requests {limit}); retry later")
        self.held.append((req, submit))

    def abort_held(self, message: str) -> None:
        """Abort every held request (lock held)."""
        held, self.held = self.held, []
        for req, _ in held:
            req.abort(message)
            self.loop.delivery.deliver_final(req)

    def abort(self, rid: str, message: str) -> bool:
        """Abort the held request ``rid`` (lock held); False when none is held."""
        for i, (req, _) in enumerate(self.held):
            if req.rid == rid:
                del self.held[i]
                req.abort(message)
                self.loop.delivery.deliver_final(req)
                return True
        return False

    # The update ------------------------------------------------------------------------------
    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 abort_all_requests: bool = False,
                                 weight_version: str | None = None) -> dict:
        """Load, check and place ``model_path``, then wait for the loop to swap it in.
        Blocks (call it from any thread but the loop's); returns SGLang's answer
        ``{"success", "message", "num_paused_requests"}``. Any problem before the swap
        answers ``success: False`` naming it and changes nothing."""
        return self._update(lambda: self._load(model_path, load_format), model_path,
                            abort_all_requests, weight_version, flush_cache=True)

    def update_weights_from_tensor(self, named_tensors: Any, load_format: str | None = None,
                                   flush_cache: bool = True, weight_version: str | None = None,
                                   abort_all_requests: bool = False) -> dict:
        """``update_weights_from_disk`` from checkpoint-named arrays instead of a directory
        (``model_executor/tensor_update.py``: any subset of names; the leaves they touch are
        rebuilt and placed as the serving ones, the rest stay). ``load_format``: None or
        ``"direct"``. ``flush_cache=False`` keeps the prefix cache (SGLang's flag: a caller
        sending the weights in several calls flushes on the last). Same answer and
        guarantees: validated and placed before the swap, nothing changed on a refusal."""
        return self._update(lambda: self._load_tensors(named_tensors, load_format),
                            "tensors", abort_all_requests, weight_version, flush_cache)

    def _update(self, load: Callable[[], tuple[Any, Any]], source: str, abort_all_requests: bool,
                weight_version: str | None, flush_cache: bool) -> dict:
        """``load()`` (placed params, placed MTP params or None), then the swap. Tensor
        updates share their untouched leaves with the serving params: the swap is refused
        when those were replaced meanwhile (an EPLB rebalance moves the experts)."""
        with self._serialize:
            if self.runner.params is None:  # released meanwhile (release_memory_occupation)
                return weight_update.update_result(
                    False, "the weights are released (release_memory_occupation); resume them first")
            t0 = time.perf_counter()
            try:
                placed, placed_mtp = load()
            except weight_update.WeightUpdateError as e:
                return weight_update.update_result(False, str(e))
            except Exception as e:  # e.g. out of device memory while placing: nothing changed
                logger.exception("loading weights from %s failed", source)
                return weight_update.update_result(
                    False, f"loading weights from {source} failed: {type(e).__name__}: {e}")
            load_s = time.perf_counter() - t0
            swap = weight_update.PendingSwap(
                placed, weight_update.next_weight_version(self.version, weight_version), source,
                mtp_params=placed_mtp, flush_cache=flush_cache,
                base=self.runner.params if source == "tensors" else None)
            del placed, placed_mtp
            loop = self.loop
            with loop.lock:
                if loop.stopping or loop.is_dead:
                    return weight_update.update_result(False, "the scheduler loop is not running")
                self.pending = swap
                if abort_all_requests:
                    loop.abort_all("Aborted for a weight update (abort_all_requests)", held=False)
                loop.wake.notify_all()
            if not loop.is_running:  # step() callers: no loop thread swaps it
                self._swap_without_loop(swap)
            while not swap.done.wait(0.1):
                if loop.stopping or loop.is_dead:
                    self._cancel(swap, "the scheduler loop stopped before the swap")
            result = swap.result
            if result["success"]:
                result["message"] += f" (loaded in {load_s:.2f} s)"
                logger.info("weight update: %s", result["message"])
            return result

    def _load_tensors(self, named_tensors: Any, load_format: str | None) -> tuple[Any, Any]:
        """The serving params (and, under NEXTN, MTP params: None when no ``mtp.*`` tensor is
        given) with the leaves the tensors touch rebuilt, in the serving layout: TP columns
        (``TPForward.tp_params``), EPLB physical expert slots (the serving params'
        ``expert_location``), DP / EP / TP shardings of the leaves they replace."""
        from sglang_tpu_backend.model_executor.tensor_update import build_params

        if load_format not in (None, "direct"):
            raise weight_update.WeightUpdateError(
                f"load_format {load_format!r} is not supported for tensors (None or 'direct': "
                "named arrays in the checkpoint's layout)")
        if self.args.nnodes > 1:
            raise weight_update.WeightUpdateError("weight updates are not supported with --nnodes > 1")
        runner, tp = self.runner, self.runner.backend.tp
        relayout = None if tp is None else functools.partial(_tp_relayout, tp)
        params = runner.params
        mtp_params = None if runner.nextn is None else runner.nextn.params
        try:
            placed, placed_mtp, report = build_params(
                named_tensors, self.model_config, params, dtype=DTYPES[self.args.dtype],
                mtp_params=mtp_params, relayout=relayout)
            weight_update.check_placed(params, placed)
            if placed_mtp is not None:
                weight_update.check_placed(mtp_params, placed_mtp)
            jax.block_until_ready((placed, placed_mtp))
        except Exception:
            if runner.params is not params:  # a rebalance donated the arrays these compared
                raise weight_update.WeightUpdateError(_REBALANCED) from None
            raise
        if runner.params is not params:  # an EPLB rebalance moved the experts meanwhile
            raise weight_update.WeightUpdateError(_REBALANCED)
        logger.info("update_weights_from_tensor: %s", report)
        return placed, placed_mtp

    def _swap_without_loop(self, swap: weight_update.PendingSwap) -> None:
        try:
            if not self.swap_if_idle():
                self._cancel(swap, "requests are running and no scheduler loop steps them")
        except Exception as e:
            logger.exception("swapping in the new weights failed")
            self.fail(f"{type(e).__name__}: {e}")

    def _load(self, model_path: str, load_format: str | None) -> tuple[Any, Any]:
        """The placed params of ``model_path`` and, under NEXTN, its placed MTP params (else
        None); WeightUpdateError naming what does not fit."""
        if load_format not in weight_update.LOAD_FORMATS:
            raise weight_update.WeightUpdateError(
                f"load_format {load_format!r} is not supported (safetensors checkpoints: "
                "'auto' or 'safetensors')")
        if self.args.nnodes > 1:
            raise weight_update.WeightUpdateError("weight updates are not supported with --nnodes > 1")
        runner, dtype = self.runner, DTYPES[self.args.dtype]
        host = weight_update.load_host_params(model_path, self.model_config, runner.param_spec,
                                              dtype=dtype)
        host_mtp = None if runner.nextn is None else weight_update.load_host_mtp_params(
            model_path, self.model_config, runner.mtp_param_spec, dtype=dtype)
        placed = runner.place_params(host)
        del host
        weight_update.check_placed(runner.params, placed)
        placed_mtp = None
        if host_mtp is not None:
            placed_mtp = runner.place_mtp_params(host_mtp)
            del host_mtp
            weight_update.check_placed(runner.nextn.params, placed_mtp)
        jax.block_until_ready((placed, placed_mtp))
        return placed, placed_mtp

    @property
    def deadline(self) -> float | None:
        """``time.monotonic()`` after which a pending swap aborts what still runs (None: no swap)."""
        if self.pending is None:
            return None
        return self.pending.queued_at + self.args.weight_update_timeout

    def swap_if_idle(self, step_in_flight: bool = False) -> bool:
        """Loop thread (or an update's caller without one): past ``--weight-update-timeout``
        abort the requests still on the old weights; swap in the pending weights once no
        request is left and no step is in flight. True when it swapped."""
        loop = self.loop
        with loop.lock:
            swap = self.pending
            if swap is None:
                return False
            # Paused (``pause_generation``): no step runs; what the paused requests hold
            # stays with them (SGLang's in-place update).
            idle = ((loop.scheduler.is_idle() or loop.paused is not None)
                    and not loop.handover.has_pending)
            limit = self.args.weight_update_timeout
            if not idle and time.monotonic() - swap.queued_at > limit:
                loop.abort_all(f"Aborted for a weight update: still running {limit:g} s after it "
                               f"was requested (--weight-update-timeout)", held=False)
                idle = True
            if step_in_flight or not idle:
                return False
            if swap.base is not None and swap.base is not self.runner.params:
                self._cancel(swap, "the serving params changed before the swap (an EPLB "
                             "rebalance moved the experts); retry the update")
                return False
            if loop.scheduler.prefix is not None and swap.flush_cache:  # the old weights' KV
                loop.scheduler.prefix.flush()  # nothing runs: every entry is freed now
        # raises: the old params are still the runner's
        self.runner.replace_params(swap.params, swap.mtp_params)
        with loop.lock:
            self.version = loop.delivery.outputs.weight_version = swap.version
            held, self.held, self.pending = self.held, [], None
            for _, submit in held:
                submit()
            waited = time.monotonic() - swap.queued_at
            swap.finish(True, f"Succeeded to update model weights from {swap.model_path}: "
                        f"weight_version {swap.version!r}; waited {waited:.2f} s for running "
                        f"requests", num_paused_requests=len(held))
            loop.wake.notify_all()
        return True

    def fail(self, message: str) -> None:
        """The swap phase raised: the old weights stay, the update answers failure."""
        if self.pending is not None:
            self._cancel(self.pending, f"swapping in the new weights failed: {message}")

    def _cancel(self, swap: weight_update.PendingSwap, message: str) -> None:
        """Give up a pending swap (old weights stay): held requests are queued now, or aborted
        when the loop is gone; the update answers failure with ``message``."""
        loop = self.loop
        with loop.lock:
            if self.pending is not swap:
                return  # done meanwhile
            self.pending = None
            if loop.stopping or loop.is_dead:
                self.abort_held(f"weight update failed: {message}")
            else:
                held, self.held = self.held, []
                for _, submit in held:
                    submit()
            loop.wake.notify_all()
            swap.finish(False, message)


def _tp_relayout(tp: Any, keys: tuple, x: Any) -> Any:
    """One leaf at ``keys`` of the params tree in the loader's layout -> the TP layout
    (``TPForward.tp_params``, which reads only the path's names)."""
    tree = x
    for k in reversed(keys):
        tree = {k: tree}
    out = tp.tp_params(tree)
    for k in keys:
        out = out[k]
    return out
