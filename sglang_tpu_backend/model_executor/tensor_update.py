"""Weights from named tensors (``update_weights_from_tensor``): checkpoint-named arrays become
the serving params tree, each new leaf placed exactly as the serving leaf it replaces.

Names are the checkpoint's (HF names, as ``update_weights_from_disk`` reads them:
``model.language_model.layers.3.mlp.experts.7.down_proj.weight``; the flat ``model.`` prefix
is taken too); values are numpy arrays or ``jax.Array``s in the checkpoint's layout ([out, in]
linear weights, per-expert or fused experts, FP8 block-scaled weights with their
``*_scale_inv``). The loader's own leaf builders (``loader.CheckpointLeaves``) turn them into
param leaves, over an in-memory reader instead of files, so every transform (transposes,
gate/up fusion, layer stacking, FP8 dequantisation, Qwen3-Next's fused projections) is the
loader's.

Any subset of names may be given. A param leaf is rebuilt when at least one of its elements
comes from a given tensor; its other elements keep their serving values: each touched leaf
is built twice, once from the tensors (zeros for the missing ones) and once from a mask
(ones for given tensors, zeros for the rest), and merged with the serving leaf where the
mask is 0 (only then is the serving leaf read back from the devices: a whole layer group's
stack, so a model sent in many small calls reads back and re-places each stacked leaf once
per call that touches it; sent whole, nothing is read back). Untouched leaves stay the
serving arrays themselves. A top-level leaf given whole
as a ``jax.Array`` of the serving dtype (``embed_tokens``, ``norm``, an untied ``lm_head``)
is taken without a copy when it is already placed as the serving leaf, else resharded
device to device; every other leaf is built on the host and placed with the serving leaf's
sharding and layout (``weight_layout.weight_target``).

Leaves are built in the loader's layout and put in the serving one before the merge
(``_Builder._serving_form``): the caller's ``relayout`` (TP: kv-head and GDN channel columns,
``TPForward.tp_params``), then, where the serving params hold an ``expert_location`` (EPLB),
the routed experts gathered per physical slot ([E, ...] -> [P, ...]: every slot holding a
logical expert, replicas included, takes its tensors). Under NEXTN the ``mtp.*`` tensors
rebuild the MTP params the same way (``CheckpointLeaves.mtp``, as ``update_weights_from_disk``
loads them).

``build_params`` validates everything (names, shapes, dtypes, FP8 scale pairs) before it
builds anything and raises ``WeightUpdateError`` naming the offending tensors; nothing here
touches the engine.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import jax
import ml_dtypes
import numpy as np

from sglang_tpu_backend.config import ModelConfig
from sglang_tpu_backend.model_executor.weight_layout import weight_target as _target
from sglang_tpu_backend.model_executor.weight_update import WeightUpdateError, placement
from sglang_tpu_backend.model_loader.checkpoint_io import (
    _NP_TO_ST, FP8_BLOCK, CheckpointError, TensorEntry)
from sglang_tpu_backend.model_loader.checkpoint_shapes import (F8_CODES, cdiv, expected_shapes,
                                                               mtp_expected_shapes)
from sglang_tpu_backend.model_loader.loader import MTP_PREFIXES, CheckpointLeaves, Leaf, _Reader

PREFIX = "model.language_model."  # names are checked and built under this prefix
LABEL = "<named tensors>"
SKIPPED = ("visual.", "model.visual.")  # vision tower tensors: not served, ignored
FLOAT_DTYPES = tuple(np.dtype(d) for d in (np.float16, np.float32, np.float64, ml_dtypes.bfloat16,
                                           ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2))
_FUSED = re.compile(rf"{re.escape(PREFIX)}layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_FUSED_ANY = re.compile(r"(.*layers\.\d+\.)mlp\.experts\.(gate_up_proj|down_proj)")
_EXPERT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")
_LAYER = re.compile(rf"{re.escape(PREFIX)}layers\.(\d+)\.")


def named_arrays(named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> dict[str, Any]:
    """``{name: array}`` of SGLang's ``[(name, tensor), ...]`` (or a mapping); each value a
    numpy array or ``jax.Array`` (anything else with ``__array__`` is converted). Raises
    WeightUpdateError on a malformed item or a name given twice."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    out: dict[str, Any] = {}
    for item in items:
        try:
            name, value = item
        except (TypeError, ValueError):
            raise WeightUpdateError("named_tensors: each item must be a (name, array) pair") from None
        if not isinstance(name, str):
            raise WeightUpdateError(f"named_tensors: a tensor name must be a string, not {name!r}")
        if name in out:
            raise WeightUpdateError(f"named_tensors: tensor {name} is given twice")
        if not isinstance(value, (np.ndarray, jax.Array)):
            if not hasattr(value, "__array__"):
                raise WeightUpdateError(f"tensor {name}: expected a numpy array or jax.Array, "
                                        f"not {type(value).__name__}")
            value = np.asarray(value)
        out[name] = value
    return out


def canonical_name(name: str) -> str:
    """``name`` under ``PREFIX`` (the flat ``model.`` form mapped onto it)."""
    if name.startswith(PREFIX) or not name.startswith("model."):
        return name
    return PREFIX + name[len("model."):]


def _few(items: list[str]) -> str:
    more = f"; ... ({len(items)} in all)" if len(items) > 5 else ""
    return "; ".join(items[:5]) + more


def _entry(name: str, shape: tuple[int, ...], code: str) -> TensorEntry:
    return TensorEntry(name, Path(LABEL), code, tuple(shape), 0, 0)


def _code(dtype: Any) -> str:
    return _NP_TO_ST.get(np.dtype(dtype), "F32")


def check_tensors(given: dict[str, Any], cfg: ModelConfig, original: dict[str, str]
                  ) -> dict[str, tuple[int, ...]]:
    """Every name the model has (this layout: per-expert, or fused where ``given`` holds a
    layer's fused experts; FP8 scales of the given FP8 weights) -> its shape. Raises
    WeightUpdateError naming unknown names, wrong shapes or dtypes, and FP8 weights without
    their ``_scale_inv`` (``original``: canonical -> given name, for the messages)."""
    entries = {n: _entry(n, a.shape, _code(a.dtype)) for n, a in given.items()}
    layout = dict(entries)
    for n in given:  # a layer whose experts come fused is checked in the fused layout
        if m := _FUSED.fullmatch(n):
            layout.setdefault(f"{PREFIX}layers.{m.group(1)}.mlp.experts.gate_up_proj",
                              _entry(n, (), "F32"))
    try:
        expected = expected_shapes(cfg, PREFIX, layout)
    except CheckpointError as e:
        raise WeightUpdateError(str(e)) from None
    _check_against(given, entries, expected, "", lambda n: original.get(n, n))
    return expected


def _check_against(given: dict[str, Any], entries: dict[str, TensorEntry],
                   expected: dict[str, tuple[int, ...]], kind: str, name=lambda n: n) -> None:
    """WeightUpdateError naming the ``given`` tensors (``kind``: "" or "MTP ") that the model
    does not have, of a wrong shape or a non-float dtype, or FP8 without their
    ``_scale_inv`` in the same update (``name``: the name to show for a canonical one)."""
    unknown = sorted(name(n) for n in given if n not in expected)
    if unknown:
        raise WeightUpdateError(f"{len(unknown)} {kind}tensor name(s) this model does not "
                                f"have: {_few(unknown)}")
    wrong = [f"{name(n)} is {list(a.shape)}, expected {list(expected[n])}"
             for n, a in given.items() if tuple(a.shape) != expected[n]]
    if wrong:
        raise WeightUpdateError(f"{len(wrong)} {kind}tensor(s) of wrong shape: {_few(wrong)}")
    bad = [f"{name(n)} is {np.dtype(a.dtype)}" for n, a in given.items()
           if np.dtype(a.dtype) not in FLOAT_DTYPES]
    if bad:
        raise WeightUpdateError(f"{len(bad)} {kind}tensor(s) of a non-float dtype: {_few(bad)}")
    lone = [name(n) for n, e in entries.items()
            if e.dtype in F8_CODES and n + "_scale_inv" not in given]
    if lone:
        raise WeightUpdateError(f"{kind}FP8 tensor(s) without their block scales (name + "
                                f"'_scale_inv') in the same update: {_few(lone)}")


class _MemoryReader(_Reader):
    """The loader's reader over ``source(name)`` (an array of the entry's shape)."""

    def __init__(self, entries: dict[str, TensorEntry], dtype: Any, source):
        super().__init__(entries, dtype)
        self.source = source

    def raw(self, name: str) -> np.ndarray:
        return self.source(name)

    def rows(self, name: str, lo: int, hi: int) -> np.ndarray:
        return self.source(name)[lo:hi]

    def direct(self, name: str) -> bool:
        return False

    def raw_into(self, name: str, out: np.ndarray) -> None:
        out[...] = self.raw(name)


def _reader_entries(given: dict[str, Any], expected: dict[str, tuple[int, ...]], dtype: Any,
                    keep_fp8: bool) -> dict[str, TensorEntry]:
    """An entry for every name the leaves may read: the given tensors as given, the rest in
    the serving dtype (kept-FP8 experts: FP8 with scales)."""
    entries = {n: _entry(n, a.shape, _code(a.dtype)) for n, a in given.items()}
    for n, shape in expected.items():
        if n in entries:
            continue
        if keep_fp8 and _EXPERT.fullmatch(n):
            entries[n] = _entry(n, shape, "F8_E4M3")
            scale = (cdiv(shape[0], FP8_BLOCK), cdiv(shape[1], FP8_BLOCK))
            entries.setdefault(n + "_scale_inv", _entry(n + "_scale_inv", scale, "F32"))
        else:
            entries[n] = _entry(n, shape, _code(dtype))
    return entries


def _param_form(leaf: Leaf, num_experts: int) -> np.ndarray:
    x = leaf.read(0, num_experts) if leaf.experts else leaf.read()
    return np.swapaxes(x, -1, -2) if leaf.swapped else x


def _node(tree: Any, keys: tuple) -> Any:
    for k in keys:
        tree = tree[k]
    return tree


def _keys(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)


class _Builder:
    """The touched leaves of one update, built and merged on the host."""

    def __init__(self, given: dict[str, Any], entries: dict[str, TensorEntry], cfg: ModelConfig,
                 params: Any, dtype: Any, keep_fp8: bool, relayout: Relayout | None = None):
        self.given, self.cfg, self.params = given, cfg, params
        self.relayout = relayout
        self.hosts: dict[str, np.ndarray] = {}

        def value(n: str) -> np.ndarray:
            if n in given:
                if n not in self.hosts:
                    self.hosts[n] = np.asarray(jax.device_get(given[n]))
                return self.hosts[n]
            return np.broadcast_to(np.zeros((), entries[n].np_dtype), entries[n].shape)

        def mask(n: str) -> np.ndarray:
            e = entries[n]
            return np.broadcast_to(np.array(1 if n in given else 0, e.np_dtype), e.shape)

        def leaves(source) -> CheckpointLeaves:
            return CheckpointLeaves.from_reader(_MemoryReader(entries, dtype, source), cfg, PREFIX,
                                                label=LABEL, keep_fp8_experts=keep_fp8)

        self.values, self.masks = leaves(value), leaves(mask)
        # Touched stacked group leaves on the host: the slices built so far (``filled``); the
        # serving stack is read back only when a slice is merged or left unbuilt (``fetched``).
        self.stacks: dict[tuple, np.ndarray] = {}
        self.filled: dict[tuple, set[int]] = {}
        self.fetched: set[tuple] = set()
        self.whole: dict[tuple, np.ndarray] = {}  # touched top-level leaves
        self.placed: dict[tuple, jax.Array] = {}
        self.num_zero_copy = self.num_mtp_leaves = 0

    def _serving_form(self, keys: tuple, x: np.ndarray, slot: int | None) -> np.ndarray:
        """A leaf in the loader's layout -> the serving one: ``relayout`` (TP columns), then,
        for a routed-expert leaf of a group whose serving params hold experts per physical
        slot (EPLB), the logical expert of each slot: x [E, ...] -> [P, ...]. ``slot``: the
        layer's index in its group's stack (None: not a stacked leaf)."""
        if self.relayout is not None:
            x = self.relayout(keys, x)
        if slot is not None and "experts" in keys:
            loc = _node(self.params, keys[:2])["mlp"].get("expert_location")
            if loc is not None:  # logical i32[G, P]: slot p of layer k holds logical[k, p]
                x = x[np.asarray(jax.device_get(loc["logical"]))[slot]]
        return x

    def _merge(self, keys: tuple, m_leaf: Leaf, v_leaf: Leaf, serving: Any, current,
               slot: int | None = None) -> np.ndarray | None:
        """The leaf's new value in the serving layout (``_serving_form``), ``current()`` (the
        serving value, read only then) where the mask is 0; None when no given tensor touches
        it. ``serving``: its shape and dtype."""
        def form(leaf: Leaf) -> np.ndarray:
            return self._serving_form(keys, _param_form(leaf, self.cfg.num_experts), slot)

        m = form(m_leaf) != 0
        if not m.any():
            return None
        v = form(v_leaf)
        if v.shape != tuple(serving.shape) or v.dtype != serving.dtype:
            raise WeightUpdateError(f"the tensors for parameter {keys} build {v.dtype}{list(v.shape)}; "
                                    f"the serving one is {serving.dtype}{list(serving.shape)}")
        return v if m.all() else np.where(m, v, current())

    def _stack(self, keys: tuple) -> np.ndarray:
        """The host stack of ``keys``: the serving values where no slice was built."""
        if keys not in self.fetched:
            cur = np.array(jax.device_get(_node(self.params, keys)))  # writable
            built = self.stacks.get(keys)
            for k in self.filled.get(keys, ()):
                cur[k] = built[k]
            self.stacks[keys], self.filled[keys] = cur, set(self.filled.get(keys, ()))
            self.fetched.add(keys)
        return self.stacks[keys]

    def layer(self, i: int) -> None:
        p = self.cfg.layer_period
        group, k = i % p, i // p
        vals = dict(jax.tree_util.tree_flatten_with_path(self.values.layer(i))[0])
        for path, m_leaf in jax.tree_util.tree_flatten_with_path(self.masks.layer(i))[0]:
            keys = ("layer_groups", group, *_keys(path))
            serving = _node(self.params, keys)
            one = jax.ShapeDtypeStruct(serving.shape[1:], serving.dtype)
            new = self._merge(keys, m_leaf, vals[path], one, lambda: self._stack(keys)[k], slot=k)
            if new is not None:
                if keys not in self.stacks:
                    self.stacks[keys], self.filled[keys] = np.empty(serving.shape, serving.dtype), set()
                self.stacks[keys][k] = new
                self.filled[keys].add(k)

    def top(self, names: dict[str, str]) -> None:
        """``names``: top-level leaf -> the tensor name it reads."""
        vals = self.values.top()
        for key, m_leaf in self.masks.top().items():
            serving = self.params[key]
            name = names[key]
            g = self.given.get(name)
            if (isinstance(g, jax.Array) and not m_leaf.swapped and g.dtype == serving.dtype
                    and g.shape == serving.shape):  # whole, on a device: no host round trip
                same = placement(g) == placement(serving)
                self.placed[(key,)] = g if same else jax.device_put(g, _target(serving))
                self.num_zero_copy += same
                continue
            new = self._merge((key,), m_leaf, vals[key], serving,
                              lambda serving=serving: np.asarray(jax.device_get(serving)))
            if new is not None:
                self.whole[(key,)] = new

    def mtp(self, mtp_params: Any) -> Any:
        """``mtp_params`` (the serving MTP tree, ``models/mtp.py``) with the leaves the given
        ``mtp.*`` tensors touch rebuilt as ``update_weights_from_disk`` loads them (the
        loader's ``CheckpointLeaves.mtp``), merged and placed as the serving leaves."""
        vals = dict(jax.tree_util.tree_flatten_with_path(self.values.mtp())[0])
        placed = {}
        for path, m_leaf in jax.tree_util.tree_flatten_with_path(self.masks.mtp())[0]:
            keys = ("mtp", *_keys(path))
            serving = _node(mtp_params, keys[1:])
            new = self._merge(keys, m_leaf, vals[path], serving,
                              lambda s=serving: np.asarray(jax.device_get(s)))
            if new is not None:
                placed[keys[1:]] = jax.device_put(np.ascontiguousarray(new), _target(serving))
        self.num_mtp_leaves = len(placed)
        return jax.tree_util.tree_map_with_path(lambda path, x: placed.get(_keys(path), x),
                                                mtp_params)

    def tree(self) -> Any:
        """The serving params with the touched leaves placed as the ones they replace."""
        for keys in list(self.stacks):
            if len(self.filled[keys]) < self.stacks[keys].shape[0]:
                self._stack(keys)  # groups not given keep their serving values
        for keys, host in [*self.stacks.items(), *self.whole.items()]:
            self.placed[keys] = jax.device_put(np.ascontiguousarray(host),
                                               _target(_node(self.params, keys)))
        return jax.tree_util.tree_map_with_path(
            lambda path, x: self.placed.get(_keys(path), x), self.params)

    @property
    def num_read_back(self) -> int:
        """Serving leaves read back to the host (partial merges, groups not given)."""
        return len(self.fetched)


def _mtp_tensors(given_raw: dict[str, Any], cfg: ModelConfig
                 ) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    """The given ``mtp.*`` tensors under one prefix (``mtp.`` or ``model.mtp.``) and every MTP
    name -> its shape (``mtp_expected_shapes``); WeightUpdateError naming unknown or misshapen
    ones (as ``check_tensors`` does for the rest)."""
    mtp = {n: a for n, a in given_raw.items() if n.startswith(MTP_PREFIXES)}
    prefixes = {p for p in MTP_PREFIXES for n in mtp if n.startswith(p)}
    if len(prefixes) > 1 or not cfg.mtp_num_hidden_layers:
        raise WeightUpdateError("MTP tensors must all be 'mtp.*' or all 'model.mtp.*', for a "
                                f"model with MTP layers: {_few(sorted(mtp))}")
    prefix = prefixes.pop()
    entries = {n: _entry(n, a.shape, _code(a.dtype)) for n, a in mtp.items()}
    for n in mtp:  # a layer whose experts come fused is checked in the fused layout
        if m := _FUSED_ANY.fullmatch(n):
            entries.setdefault(f"{m.group(1)}mlp.experts.gate_up_proj", _entry(n, (), "F32"))
    expected = mtp_expected_shapes(cfg, prefix, entries)
    _check_against(mtp, entries, expected, "MTP ")
    return mtp, expected


Relayout = Callable[[tuple, np.ndarray], np.ndarray]


def build_params(named_tensors: Any, cfg: ModelConfig, params: Any, *, dtype: Any,
                 mtp_params: Any = None, relayout: Relayout | None = None
                 ) -> tuple[Any, Any, dict]:
    """``params`` (the serving tree) with the leaves ``named_tensors`` touch replaced, placed
    as the serving leaves; the same for ``mtp_params`` (the serving MTP tree under NEXTN, else
    None: ``mtp.*`` tensors are then ignored), None when no ``mtp.*`` tensor is given; and a
    report ``{"num_tensors", "num_ignored", "num_leaves", "num_mtp_leaves", "num_zero_copy",
    "num_read_back"}`` (leaves placed; taken without a copy; read back from the devices to
    merge). ``relayout(keys, x)``: a leaf x in the loader's layout at ``keys`` of the params
    tree -> the serving layout's (TP: ``TPForward.tp_params``; None: the same). Routed experts
    are placed per physical slot where the serving params hold an ``expert_location`` (EPLB:
    every slot holding a logical expert, replicas included, gets that expert's tensors).
    Raises WeightUpdateError (nothing built) naming what does not fit."""
    given_raw = named_arrays(named_tensors)
    if not given_raw:
        raise WeightUpdateError("named_tensors is empty")
    mtp, mtp_expected = {}, {}
    if mtp_params is not None and any(n.startswith(MTP_PREFIXES) for n in given_raw):
        mtp, mtp_expected = _mtp_tensors(given_raw, cfg)
    ignored = [n for n in given_raw if n.startswith(SKIPPED + MTP_PREFIXES) and n not in mtp]
    original = {canonical_name(n): n for n in given_raw if n not in ignored and n not in mtp}
    given = {c: given_raw[n] for c, n in original.items()}
    if len(given) + len(ignored) + len(mtp) != len(given_raw):
        raise WeightUpdateError("named_tensors names one tensor in both the 'model.' and the "
                                "'model.language_model.' form")
    expected = check_tensors(given, cfg, original) if given else {}
    keep_fp8 = any("gate_up_scale" in _keys(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0])
    entries = _reader_entries({**given, **mtp}, {**expected, **mtp_expected}, dtype, keep_fp8)
    b = _Builder({**given, **mtp}, entries, cfg, params, dtype, keep_fp8, relayout)
    for i in sorted({int(m.group(1)) for n in given if (m := _LAYER.match(n))}):
        b.layer(i)
    embed = f"{PREFIX}embed_tokens.weight"
    top = {"embed_tokens": embed, "norm": f"{PREFIX}norm.weight",
           "lm_head": embed if cfg.tie_word_embeddings else "lm_head.weight"}
    if any(n in given for n in top.values()):
        b.top(top)
    tree = b.tree() if given else params
    mtp_tree = b.mtp(mtp_params) if mtp else None
    return tree, mtp_tree, {"num_tensors": len(given) + len(mtp), "num_ignored": len(ignored),
                            "num_leaves": len(b.placed), "num_mtp_leaves": b.num_mtp_leaves,
                            "num_zero_copy": b.num_zero_copy, "num_read_back": b.num_read_back}
