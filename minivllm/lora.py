"""Chapter 17: one base, many adapters. LoRA served per request, side by side in one batch.

A LoRA adapter changes a weight W by a low-rank product, W + scale · B·A (A: rank x in,
B: out x rank), and is trained and saved by `peft` as adapter_config.json beside
adapter_model.safetensors. Merged into W it would be one more copy of the model; kept beside
it, every row of a batch can take its own adapter in the same forward pass:

    y = x·Wᵀ                        the base, for every row, one matmul as before
    y += (x·Aᵀ)·Bᵀ · scale          shrink to rank r, expand back: only rows with an adapter

The rows of a step are grouped by adapter (Punica's SGMV, S-LoRA's idea): one gather of those
rows, one batched shrink and one batched expand over the step's adapters, one add back. The
model's fused projections stay fused: an adapter on q alone writes q's slice of qkv's output.
At most `max_loras` adapters sit in the device slots that the step reads; more wait in host
memory (`max_cpu_loras`) and take the least recently used slot when a step needs them. peft's
files are read and checked in lora_files.py.
"""

from __future__ import annotations

import collections
import functools
import itertools
import threading
from dataclasses import dataclass

import torch

from minivllm.config import check_option
from minivllm.cuda_graphs import CUDAGraphRunner, CUDAGraphs
from minivllm.lora_files import LoRARequest, module_sizes, read_adapter
from minivllm.model import LlamaModel, ModelConfig
from minivllm.model_runner import ModelRunner
from minivllm.parallel import RowParallel, Shard
from minivllm.weights import matmul

# our fused weights -> peft's modules stacked in each, in the order of the weight's output rows
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}


@dataclass(eq=False)
class Adapter:
    """One adapter in host memory: its weights, its name, and the key its cached prefixes carry."""

    request: LoRARequest
    weights: dict
    key: int            # unique per load: a reloaded adapter shares no cached block with its old self
    rank: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.weights.values() for t in pair)


# --8<-- [start:plan]
@dataclass
class StepPlan:
    """Which rows of this step take which slot: computed once a step, read by every layer."""

    slots: torch.Tensor      # [S] the step's slots, one per distinct adapter
    gather: torch.Tensor     # [S, longest] the flat tokens of each slot's rows, padded with token 0
    valid: torch.Tensor      # positions in gather.view(-1) that are real tokens
    tokens: torch.Tensor     # ... and the flat token each of them is


def plan_step(row_slots: list[int | None], lengths: list[int], device) -> StepPlan | None:
    """Group the step's tokens by slot; None when no row has an adapter: the base runs alone."""
    by_slot: dict[int, list[int]] = collections.defaultdict(list)
    offsets = [0, *itertools.accumulate(lengths)]
    for slot, start, end in zip(row_slots, offsets, offsets[1:]):
        if slot is not None:
            by_slot[slot].extend(range(start, end))
    if not by_slot:
        return None
    longest = max(map(len, by_slot.values()))
    gather = [toks + [0] * (longest - len(toks)) for toks in by_slot.values()]
    valid = [i * longest + j for i, toks in enumerate(by_slot.values()) for j in range(len(toks))]
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return StepPlan(as_tensor(list(by_slot)), as_tensor(gather), as_tensor(valid),
                    as_tensor([t for toks in by_slot.values() for t in toks]))
# --8<-- [end:plan]


# --8<-- [start:row-plan]
@dataclass
class RowPlan:
    """A CUDA graph's plan (Chapter 15): one token a row, each row's slot in a static buffer, and
    a 1 beside each row that has an adapter, 0 beside the base's rows and the padding. A graph
    records the addresses; every replay reads the values the step wrote there."""

    slot: torch.Tensor       # [rows] long: the row's slot (any slot where `on` is 0)
    on: torch.Tensor         # [rows] the model's dtype: 1 where the row's adapter applies
# --8<-- [end:row-plan]


# --8<-- [start:weight]
class LoRAWeight:
    """A base weight with the step's adapters beside it: x·Wᵀ, plus, for the rows that have one,
    their adapter's shrink (A) then expand (B), batched over the step's adapters."""

    def __init__(self, wrapped, slots: LoRA, a: torch.Tensor, b: torch.Tensor):
        self.wrapped, self.slots = wrapped, slots
        self.a, self.b = a, b                # [max_loras, parts·rank, in], [max_loras, out, parts·rank]

    def replace(self, wrapped) -> LoRAWeight:
        return LoRAWeight(wrapped, self.slots, self.a, self.b)

    @property
    def nbytes(self) -> int:
        return getattr(self.wrapped, "nbytes", None) or self.wrapped.numel() * self.wrapped.element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        y, plan = matmul(self.wrapped, x), self.slots.plan
        if plan is None:                     # no row has an adapter: the base's cost, nothing more
            return y
        if isinstance(plan, RowPlan):        # a graph's decode step: each row gathers its own slot
            slot, on = plan.slot[:x.shape[0]], plan.on[:x.shape[0], None]
            a, b = self.a[slot], self.b[slot]                     # [rows, parts·rank, in], [rows, out, ...]
            delta = torch.bmm(torch.bmm(x[:, None].to(a.dtype), a.transpose(1, 2)), b.transpose(1, 2))
            return y + (delta[:, 0] * on).to(y.dtype)
        a, b = self.a[plan.slots], self.b[plan.slots]             # the step's adapters only
        rows = x[plan.gather].to(a.dtype)                         # [S, longest, in]
        delta = torch.bmm(torch.bmm(rows, a.transpose(1, 2)), b.transpose(1, 2))   # shrink, expand
        return y.index_add_(0, plan.tokens, delta.flatten(0, 1)[plan.valid].to(y.dtype))
# --8<-- [end:weight]


class LoRA:
    """The adapters an engine serves, as a feature handed to the model (its weights gain the
    adapters' slots) and to the runner (each step says which rows take which adapter)."""

    name = "lora"

    def __init__(self, max_loras: int = 1, max_lora_rank: int = 16, max_cpu_loras: int | None = None):
        for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank),
                            ("max_cpu_loras", max_cpu_loras)):
            check_option(name, value)      # the bounds of the options table (minivllm/config.py)
        if max_cpu_loras is not None and max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.max_loras, self.max_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.config: ModelConfig | None = None    # the model's, as this process holds it (a rank's share)
        self.whole: ModelConfig | None = None     # the whole model's: what an adapter's shapes must match
        self.shard: Shard | None = None           # a tensor-parallel rank's (Chapter 14): A and B split too
        self.plan: StepPlan | RowPlan | None = None
        self.copies: list = []                    # this step's slot writes, which the other ranks repeat
        self.followed: collections.OrderedDict[int, dict] = collections.OrderedDict()   # a worker's adapters
        self.host: collections.OrderedDict[int, Adapter] = collections.OrderedDict()   # by lora_int_id, LRU order
        self.in_slot: list[int | None] = [None] * max_loras       # each slot's adapter key
        self.slot_lru: collections.OrderedDict[int, None] = collections.OrderedDict((i, None) for i in range(max_loras))
        self.in_use: collections.Counter = collections.Counter()  # adapter key -> requests holding it
        self._keys, self._lock = itertools.count(1), threading.Lock()
        self.num_swaps = 0

    def __reduce__(self):
        """What a tensor-parallel worker receives: the options only. It reads its own share of each
        adapter when rank 0 first puts that adapter in a slot."""
        return LoRA, (self.max_loras, self.max_rank, self.max_cpu_loras)

    def split_as(self, shard: Shard) -> None:
        self.shard = shard

    # --8<-- [start:call]
    def __call__(self, model: LlamaModel) -> LlamaModel:
        """The model with every layer's four projections wrapped: slots of zeros, filled on demand.
        On a tensor-parallel rank the slots hold the rank's share: for q, k, v, gate and up all of
        A and the rows of B that make the rank's outputs; for o and down the columns of A that read
        the rank's inputs and all of B, the delta a partial sum added before the base's all-reduce."""
        self.config, sizes, w = model.config, module_sizes(model.config), dict(model.w)
        self.whole = self.shard.whole if self.shard is not None else model.config
        self.slots = {}
        for i in range(model.config.num_layers):
            for fused, parts in FUSED.items():
                fan_in = sizes[parts[0]][0]
                fan_out = sum(sizes[p][1] for p in parts)
                a = torch.zeros(self.max_loras, len(parts) * self.max_rank, fan_in, dtype=model.dtype,
                                device=model.device)
                b = torch.zeros(self.max_loras, fan_out, len(parts) * self.max_rank, dtype=model.dtype,
                                device=model.device)
                self.slots[(i, fused)] = (a, b)
                name, base = f"model.layers.{i}.{fused}", w[f"model.layers.{i}.{fused}"]
                w[name] = base.replace(LoRAWeight(base.wrapped, self, a, b)) if isinstance(base, RowParallel) \
                    else LoRAWeight(base, self, a, b)
        return model.with_weights(w)
    # --8<-- [end:call]

    @property
    def slot_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.slots.values() for t in pair)

    # --8<-- [start:add]
    def add(self, request: LoRARequest) -> Adapter:
        """The adapter of this request, read from its folder the first time (ValueError if it
        cannot be applied), then kept in host memory; the least recently used idle one makes room."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        with self._lock:
            held = self.host.get(request.lora_int_id)
            if held is not None and held.request != request:
                raise ValueError(f"lora_int_id {request.lora_int_id} is {held.request.lora_name!r} "
                                 f"({held.request.lora_path}); remove it before reusing the id")
            if held is not None:
                self.host.move_to_end(request.lora_int_id)
                return held
        weights = read_adapter(request.lora_path, self.whole, self.max_rank)   # outside the lock: disk
        with self._lock:
            if request.lora_int_id in self.host:
                return self.host[request.lora_int_id]
            if len(self.host) >= self.max_cpu_loras:
                idle = [i for i, a in self.host.items() if not self.in_use[a.key]]
                if not idle:
                    raise ValueError(f"max_cpu_loras={self.max_cpu_loras} adapters are held and all are in use")
                self.host.pop(idle[0])
            rank = max(a.shape[0] for a, _ in weights.values())
            adapter = self.host[request.lora_int_id] = Adapter(request, weights, next(self._keys), rank)
            return adapter
    # --8<-- [end:add]

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter: requests already holding it finish with it; False if it was not held."""
        with self._lock:
            return self.host.pop(lora_int_id, None) is not None

    def adapters(self) -> list[LoRARequest]:
        with self._lock:
            return [a.request for a in self.host.values()]

    def hold(self, adapter: Adapter) -> None:
        """A request in the engine applies it: it stays in host memory until let go."""
        with self._lock:
            self.in_use[adapter.key] += 1

    def let_go(self, adapter: Adapter) -> None:
        with self._lock:
            self.in_use[adapter.key] -= 1
            if self.in_use[adapter.key] <= 0:
                del self.in_use[adapter.key]

    def admit(self, request) -> None:
        if request.adapter is not None:
            self.hold(request.adapter)        # in host memory until it leaves

    def release(self, request) -> None:
        if request.adapter is not None:
            self.let_go(request.adapter)

    # --8<-- [start:activate]
    def activate(self, adapters: list[Adapter | None], lengths: list[int], device) -> None:
        """Before a step: each distinct adapter in a device slot, then the step's plan."""
        self.plan = plan_step(self.place(adapters), lengths, device)

    def place(self, adapters: list[Adapter | None]) -> list[int | None]:
        """Each distinct adapter of the step in a device slot (the least recently used slot that no
        row of this step needs is overwritten); each row's slot, None for the base's rows."""
        self.copies = []
        wanted = list({a.key: a for a in adapters if a is not None}.values())
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step with {len(wanted)} adapters, max_loras={self.max_loras}")
        slot_of = {}
        for adapter in wanted:
            if adapter.key in self.in_slot:
                slot_of[adapter.key] = self.in_slot.index(adapter.key)
        for adapter in wanted:
            if adapter.key not in slot_of:
                free = next(s for s in self.slot_lru if s not in slot_of.values())
                self._copy_in(adapter.key, adapter.weights, free)
                self.copies.append((free, adapter.request, adapter.key))
                slot_of[adapter.key] = free
            self.slot_lru.move_to_end(slot_of[adapter.key])
        return [None if a is None else slot_of[a.key] for a in adapters]
    # --8<-- [end:activate]

    # --8<-- [start:ranks]
    def lead(self, requests, lengths: list[int], device) -> tuple:
        """Rank 0, before a tensor-parallel step (Chapter 14): its own slots and plan, and the note
        every other rank follows: which adapter went into which slot, which row takes which slot."""
        rows = self.place([r.adapter for r in requests])
        self.plan = plan_step(rows, lengths, device)
        with self._lock:   # what the other ranks may keep: what rank 0 holds, or still runs with
            held = {a.key for a in self.host.values()} | set(self.in_use)
        return rows, self.copies, held

    def follow(self, note: tuple, lengths: list[int], device) -> None:
        """Any other rank: the same slots as rank 0, each filled with this rank's share, read from
        the adapter's folder once and kept while rank 0 keeps the adapter; then the same plan."""
        rows, copies, held = note
        for slot, request, key in copies:
            if key not in self.followed:
                self.followed[key] = read_adapter(request.lora_path, self.whole, self.max_rank)
            self._copy_in(key, self.followed[key], slot)
        for key in [k for k in self.followed if k not in held]:
            del self.followed[key]
        self.plan = plan_step(rows, lengths, device)

    def local(self, part: str, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of one module's A and B, cut as Chapter 14 cuts the module's weight:
        B's rows of a column-split one (q, k, v, gate, up), A's columns of a row-split one (o, down)."""
        if self.shard is None:
            return a, b
        index = self.shard.part(f"{part}.weight", self.whole)
        return (a, b[index]) if len(index) == 1 else (a[index], b)
    # --8<-- [end:ranks]

    def _copy_in(self, key: int, weights: dict, slot: int) -> None:
        """Write an adapter into a slot: each module's A and B at its part's rows and columns, zero elsewhere."""
        r, sizes = self.max_rank, module_sizes(self.config)
        for (i, fused), (a, b) in self.slots.items():
            a[slot].zero_()
            b[slot].zero_()
            row = 0
            for j, part in enumerate(FUSED[fused]):
                out = sizes[part][1]
                pair = weights.get((i, part))
                if pair is not None:
                    la, lb = self.local(part, *pair)
                    a[slot, j * r: j * r + la.shape[0]] = la.to(a.dtype)
                    b[slot, row: row + out, j * r: j * r + la.shape[0]] = lb.to(b.dtype)
                row += out
        self.in_slot[slot] = key
        self.num_swaps += 1

    def runner(self, model: LlamaModel, kv) -> LoRARunner:
        return LoRARunner(model, kv, self)

    def graph_runner(self, graphs: CUDAGraphs, model: LlamaModel, kv) -> LoRAGraphRunner:
        return graphs.runner(model, kv, functools.partial(LoRAGraphRunner, lora=self))

    def features(self) -> dict:
        return {"lora": {"max_loras": self.max_loras, "max_lora_rank": self.max_rank,
                         "max_cpu_loras": self.max_cpu_loras, "adapters": [a.lora_name for a in self.adapters()]}}


# --8<-- [start:runner]
class LoRARunner(ModelRunner):
    """Chapter 6's runner whose every batch says which rows take which adapter."""

    def __init__(self, model: LlamaModel, kv, lora: LoRA):
        super().__init__(model, kv)
        self.lora = lora

    def prepare(self, requests, starts, lengths, places):
        self.lora.activate([r.adapter for r in requests], lengths, self.model.device)
        return super().prepare(requests, starts, lengths, places)

    def admit(self, request) -> None:
        self.lora.admit(request)              # its adapter stays in host memory until it leaves

    def release(self, request) -> None:
        self.lora.release(request)

    def features(self) -> dict:
        return self.lora.features()
# --8<-- [end:runner]


# --8<-- [start:graph-runner]
class LoRAGraphRunner(CUDAGraphRunner):
    """Chapter 15's runner with adapters: a decode step writes each row's slot into one more static
    buffer, which every graph reads (RowPlan); the steps that stay eager take Chapter 17's plan."""

    def __init__(self, model: LlamaModel, kv, max_num_seqs: int, max_model_len: int, lora: LoRA):
        super().__init__(model, kv, max_num_seqs, max_model_len)
        rows, self.lora = self.buckets[-1], lora
        self.rows = RowPlan(torch.zeros(rows, dtype=torch.long, device=model.device),
                            torch.zeros(rows, dtype=model.dtype, device=model.device))

    def prepare(self, requests, starts, lengths, places):
        self.lora.activate([r.adapter for r in requests], lengths, self.model.device)
        return super().prepare(requests, starts, lengths, places)

    def fill(self, requests, starts, places) -> int:
        size = super().fill(requests, starts, places)
        slots = self.lora.place([r.adapter for r in requests])
        pad = [None] * (size - len(slots))    # padding rows, like the base's, apply nothing
        self.rows.slot[:size].copy_(torch.tensor([s or 0 for s in slots + pad], dtype=torch.long))
        self.rows.on[:size].copy_(torch.tensor([s is not None for s in slots + pad], dtype=self.rows.on.dtype))
        self.lora.plan = self.rows
        return size

    def capture(self) -> float:
        self.lora.plan = self.rows            # every graph records the per-row path over these buffers
        try:
            return super().capture()
        finally:
            self.lora.plan = None

    def admit(self, request) -> None:
        self.lora.admit(request)

    def release(self, request) -> None:
        self.lora.release(request)

    def features(self) -> dict:
        return self.lora.features()
# --8<-- [end:graph-runner]
