"""EAGLE and EAGLE-3 heads propose the next tokens from the target's own hidden states
(vLLM's `method: "eagle"` / `"eagle3"`).

After each target step the target model runner hands over the hidden states of every token
it forwarded (`ModelRunner.hidden_states_hook`), from an eager or compiled forward or a
CUDA graph replay: the final ones for EAGLE-1, the inputs of three layers for EAGLE-3 (a
second output of the target's forward, `LlamaForCausalLM.aux_hidden_state_layers`, set by
`engine.prepare_target` before the target is compiled or captured). The head pairs the
target's feature at position p with token p+1, so only the positions whose inputs the
target kept are fed: for a verified step, the accepted drafts and the token before them;
the rejected ones are fed again once the target recomputes them.

The head has its own `ModelRunner` and paged KV pool, but no block manager: its pool has
as many blocks as the target's, of the same size, and is indexed by the target's block ids
through the target's own block table (vLLM keeps the head's KV layers in the target's
block table the same way). A prefix-cache hit is therefore a hit for the head's KV too,
written when those blocks were first computed; blocks the target frees, evicts, trims
(rejected drafts) or loses to preemption are simply overwritten when next computed. Only
the draft positions past the end of the target's table (it allocates their slots when it
verifies them) go to a few scratch blocks after the target's (`size_kv_pool` counts the
pool and `draft_pool_sizes` the scratch). A target whose table is not one plain table
(KV cache groups, sliding windows) is refused.

Each step the head first writes its cache from the new target features (one batched
forward, split by its token budget), which yields the first draft at each speculating
request's last position; then it drafts the rest autoregressively, one batched forward per
position, reading its own output hidden state where the target's is not known yet. Drafts
are argmax picks, so the rejection sampler sees one-hot draft distributions and sampling
stays exact.

Limits, said plainly: a cached block's head KV was written from the request that computed
it, so its last position (which pairs the feature there with the *next* token, outside the
block's hash) may belong to another continuation; a request that finishes in the step that
computed some positions leaves those positions unwritten (the head is fed only live
requests). Both cost acceptance, not correctness. The head itself runs eagerly; single
device only.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from pagemill.blockpool import HybridKVCacheManager, KVCacheManager
from pagemill.runtime.model_config import ModelConfig
from pagemill.runtime.model_executor.models.llama import LlamaForCausalLM
from pagemill.runtime.model_executor.models.llama_eagle import EagleHeadBase
from pagemill.runtime.sampling_params import SamplingParams
from pagemill.runtime.spec_decode.eagle_checkpoint import (
    head_config,
    head_tensor_names,
    iterate_head_weights,
    read_head_config,
)
from pagemill.scheduler import Request, ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from pagemill.runtime.spec_decode.proposer import ProposerSetup
    from pagemill.runtime.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0)
# The checkpoint architectures each method reads (vLLM's names and the EAGLE repo's).
EAGLE_ARCHITECTURES = {
    "eagle": ("EagleLlamaForCausalLM", "LlamaForCausalLMEagle", "LlamaForCausalLM"),
    "eagle3": ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3", "LlamaForCausalLM"),
}
# Targets whose model is the plain Llama module (its layers take (positions, x, residual)).
LLAMA_TARGETS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass
class _HeadState:
    shadow: Request  # the head runner's view of the request (its sampling record)
    fed: int = 0  # head KV positions written from target features (valid, not drafts)
    last: torch.Tensor | None = None  # the target feature at position fed - 1


@dataclass
class _Feed:
    """Head positions [start, start + len(token_ids)) to write, and whether the last one
    yields a draft."""

    state: _HeadState
    start: int
    token_ids: list[int]
    features: torch.Tensor  # [len(token_ids), feature size], the target's
    sample: bool
    done: int = 0


@dataclass
class _Capture:
    """One target step: its scheduled requests (request, first position, token count, first
    row) and the features of all its tokens."""

    rows: list[tuple[Request, int, int, int]]
    features: torch.Tensor


def aux_layer_ids(raw: dict[str, Any], num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's three target layers (each id: that layer's input; 0 is the embedding),
    from the head's config or vLLM's default (2, L // 2, L - 3)."""
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    eagle_config = raw.get("eagle_config") or {}
    if ids is None and isinstance(eagle_config, dict):
        ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    source = "eagle_aux_hidden_state_layer_ids"
    if ids is None:
        n = num_target_layers
        ids, source = [2, n // 2, n - 3], f"the default (2, L // 2, L - 3) for L={n}"
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3 or any(not 0 <= i < num_target_layers for i in ids):
        raise ValueError(
            f"speculative_config.model: EAGLE-3 needs three target layer ids in "
            f"[0, {num_target_layers}); {source} gives {list(ids)}"
        )
    return ids


def check_head(
    method: str,
    raw: dict[str, Any],
    head: ModelConfig,
    target: ModelConfig,
    names: set[str],
) -> None:
    """Refuse, by name, a head pagemill would run wrongly."""
    archs = raw.get("architectures") or []
    known = EAGLE_ARCHITECTURES[method]
    other = "eagle3" if method == "eagle" else "eagle"
    if any(a in EAGLE_ARCHITECTURES[other][:2] for a in archs):
        raise ValueError(
            f"speculative_config.model is an {other} head ({archs}); set method {other!r}"
        )
    if not any(a in known for a in archs) or raw.get("model_type", "llama") != "llama":
        raise ValueError(
            f"speculative_config.model: method {method!r} reads Llama EAGLE heads "
            f"(architectures {', '.join(known[:2])}), got {archs or raw.get('model_type')!r}"
        )
    if target.architecture not in LLAMA_TARGETS:
        raise ValueError(
            f"speculative_config.method={method!r} needs a Llama-family target "
            f"({', '.join(LLAMA_TARGETS)}); the model is {target.architecture}"
        )
    if any(target.layer_window(i) for i in range(target.num_hidden_layers)):
        raise ValueError(
            f"speculative_config.method={method!r}: the head keeps its KV in the target's "
            f"block table, which a sliding-window target ({target.architecture}, "
            f"sliding_window={target.sliding_window}) gives back behind the window"
        )
    if raw.get("add_para_norm"):
        raise ValueError("speculative_config.model: HASS heads (add_para_norm) are not supported")
    if head.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model: the head's vocab_size ({head.vocab_size}) differs "
            f"from the target's ({target.vocab_size})"
        )
    if method == "eagle":
        if head.hidden_size != target.hidden_size:
            raise ValueError(
                f"speculative_config.model: the EAGLE head's hidden_size ({head.hidden_size}) "
                f"differs from the target's ({target.hidden_size})"
            )
        return
    eagle_config = raw.get("eagle_config") or {}
    if isinstance(eagle_config, dict) and eagle_config.get("use_aux_hidden_state") is False:
        raise ValueError(
            "speculative_config.model: EAGLE-3 heads without auxiliary hidden states "
            "(eagle_config.use_aux_hidden_state=false) are not supported"
        )
    target_hidden = int(raw.get("target_hidden_size") or head.hidden_size)
    if target_hidden != target.hidden_size:
        raise ValueError(
            f"speculative_config.model: the head's target_hidden_size ({target_hidden}) "
            f"differs from the target's hidden_size ({target.hidden_size})"
        )
    if "embed_tokens.weight" not in names and head.hidden_size != target.hidden_size:
        raise ValueError(
            "speculative_config.model: the head has no embedding of its own and its "
            "hidden_size differs from the target's"
        )
    draft_vocab = int(raw.get("draft_vocab_size") or head.vocab_size)
    if draft_vocab != target.vocab_size and "d2t" not in names:
        raise ValueError(
            f"speculative_config.model: the head drafts over {draft_vocab} ids, the target "
            f"has {target.vocab_size}, and the checkpoint has no d2t map between them"
        )


def scratch_blocks_per_request(k: int, block_size: int) -> int:
    """Head blocks one drafting request may need past the end of the target's table.

    The k - 1 autoregressive draft positions (the first draft comes from the feed) start
    at the request's first uncomputed position; the target allocates their slots only when
    it verifies them, so the part of them past its table lands in scratch blocks."""
    return -(-(k - 1) // block_size)


class EagleProposer:
    """Drafts from an EAGLE head whose KV pool is indexed by the target's block ids.

    The head reads and writes its cache through the target's own block table (the pools
    have as many blocks, of the same size), so what the target's block pool decides holds
    for the head's cache too: a prefix-cache hit is a hit for the head's KV (written when
    those blocks were first computed), freed and evicted blocks are simply overwritten
    later, and the head needs no block manager of its own. Only the draft positions past
    the end of the target's table (it has not allocated them yet) go to a few scratch
    blocks after the target's, handed out afresh at every call.
    """

    def __init__(
        self,
        method: str,
        head: EagleHeadBase,
        runner: ModelRunner,
        target_runner: ModelRunner,
        target_kv: KVCacheManager,
        num_blocks: int,
        k: int,
        max_model_len: int,
        aux_layers: tuple[int, ...] = (),
    ) -> None:
        self.method = method
        self.head = head
        self.runner = runner
        self.k = k
        self.max_model_len = max_model_len
        self.target_kv = target_kv
        self.num_blocks = num_blocks
        self.scratch_per_request = scratch_blocks_per_request(k, runner.block_size)
        self.num_scratch = runner.max_num_seqs * self.scratch_per_request
        self.budget = runner.max_num_batched_tokens
        self.states: dict[str, _HeadState] = {}
        self._finished: list[str] = []
        self._capture: _Capture | None = None
        self.aux_layers = aux_layers
        # This call's head block tables (sent whole at a request's first forward of the
        # call) and the next free scratch block.
        self._tables: dict[str, list[int]] = {}
        self._next_scratch = num_blocks
        self.target_runner = target_runner
        # Every target step hands its hidden states over, eager, compiled or replayed from
        # a CUDA graph; EAGLE-3's layer inputs come out of the target's forward
        # (`prepare_target` set its `aux_hidden_state_layers` before it was compiled).
        target_runner.hidden_states_hook = self._on_target_step
        if aux_layers and tuple(target_runner.model.aux_hidden_state_layers) != aux_layers:
            raise RuntimeError(
                f"EAGLE-3 needs the target's forward to return layers {list(aux_layers)}; "
                "call spec_decode.engine.prepare_target before compiling the target"
            )

    # ---------------------------------------------------------------- loading

    @classmethod
    def load(
        cls,
        method: str,
        setup: ProposerSetup,
        *,
        target_runner: ModelRunner,
        target_kv: KVCacheManager | HybridKVCacheManager,
    ) -> EagleProposer:
        from pagemill.runtime.model_executor.loader import resolve_model_path
        from pagemill.runtime.model_executor.models.llama_eagle import EagleLlamaForCausalLM
        from pagemill.runtime.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
        from pagemill.runtime.worker.model_runner import ModelRunner

        folder = resolve_model_path(setup.model, None)
        raw = read_head_config(folder)
        config = head_config(folder)
        names = head_tensor_names(folder)
        target_config = setup.target_config
        check_head(method, raw, config, target_config, names)
        if not isinstance(target_kv, KVCacheManager) or target_runner.kv_cache_groups:
            raise ValueError(
                f"speculative_config.method={method!r}: the head shares the target's one "
                "block table; a target with KV cache groups has several"
            )
        dtype, max_model_len = setup.dtype, setup.max_model_len
        target = target_runner.model
        if type(target) is not LlamaForCausalLM:
            raise ValueError(
                f"speculative_config.method={method!r} needs a Llama-family target; "
                f"{target_config.architecture} is served by {type(target).__name__}"
            )
        aux: tuple[int, ...] = ()
        head: EagleHeadBase
        with torch.device(setup.device):
            if method == "eagle":
                head = EagleLlamaForCausalLM(
                    config,
                    dtype,
                    max_model_len,
                    target.embed,
                    target.compute_logits,
                    fc_bias="fc.bias" in names,
                )
            else:
                aux = aux_layer_ids(raw, target_config.num_hidden_layers)
                head = Eagle3LlamaForCausalLM(
                    config,
                    dtype,
                    max_model_len,
                    target_embed=target.embed,
                    target_hidden_size=target_config.hidden_size,
                    draft_vocab_size=int(raw.get("draft_vocab_size") or config.vocab_size),
                    own_embedding="embed_tokens.weight" in names,
                    norm_before_residual=bool(raw.get("norm_before_residual", False)),
                )
                head.has_d2t = "d2t" in names
        head.load_weights(iterate_head_weights(folder))
        head.eval()
        runner = ModelRunner(
            cast(LlamaForCausalLM, head),
            config,
            setup.device,
            dtype,
            setup.block_size,
            setup.max_num_seqs,
            setup.runner_budget,
            max_model_len,
        )
        k, num_blocks = setup.num_speculative_tokens, setup.num_blocks
        scratch = setup.max_num_seqs * scratch_blocks_per_request(k, setup.block_size)
        runner.init_kv_cache(num_blocks + scratch, prefault=False)  # SpecDecoding.start_prefault
        logger.info(
            "%s head %s: %d layer(s), its KV in the target's %d blocks (+%d scratch)%s",
            method,
            folder,
            config.num_hidden_layers,
            num_blocks,
            scratch,
            f", target layers {list(aux)}" if aux else "",
        )
        return cls(
            method, head, runner, target_runner, target_kv, num_blocks, k, max_model_len, aux
        )

    # ---------------------------------------------------------------- target hooks

    def _on_target_step(self, out: SchedulerOutput, hidden: torch.Tensor) -> None:
        rows: list[tuple[Request, int, int, int]] = []
        row = 0
        for s in out.scheduled:
            rows.append((s.request, s.start_pos, s.num_tokens, row))
            row += s.num_tokens
        features = hidden
        if self.aux_layers:
            aux = self.target_runner.aux_hidden_states
            assert aux is not None, "the target's forward returned no auxiliary states"
            features = aux
        self._capture = _Capture(rows, features)

    # ---------------------------------------------------------------- per step

    @torch.inference_mode()
    def propose_requests(
        self, requests: Sequence[Request], rooms: Sequence[int], live: Collection[str]
    ) -> dict[str, list[int]]:
        for rid in [r for r in self.states if r not in live]:
            self._drop(rid)
        self._tables = {}
        self._next_scratch = self.num_blocks
        capture, self._capture = self._capture, None
        want = {
            r.request_id: min(room, self.max_model_len - r.num_tokens)
            for r, room in zip(requests, rooms)
        }
        want = {rid: n for rid, n in want.items() if n > 0}
        feeds = self._feeds(capture, live, requests, want)
        drafts: dict[str, list[int]] = {}
        carry: dict[str, torch.Tensor] = {}
        self._run_feeds(feeds, drafts, carry)
        steps = {rid: d for rid, d in drafts.items() if len(d) < want[rid]}
        while steps:
            steps = self._draft_step(steps, carry, want)
        return {rid: d for rid, d in drafts.items() if d}

    def _feeds(
        self,
        capture: _Capture | None,
        live: Collection[str],
        requests: Sequence[Request],
        want: dict[str, int],
    ) -> list[_Feed]:
        """What to write into the head's cache: the new target positions of every request
        the last step forwarded, and the last position again for a speculating request
        whose last step brought nothing new (so that it yields a draft)."""
        feeds: dict[str, _Feed] = {}
        if capture is not None:
            for req, start, n, row in capture.rows:
                rid = req.request_id
                if rid not in live:
                    continue
                tokens = req.all_token_ids
                end = min(start + n, req.num_computed_tokens, len(tokens) - 1)
                if end <= start:
                    continue
                state = self.states.get(rid)
                if state is None:
                    shadow = Request(rid, [tokens[0]], sampling_params=_GREEDY)
                    state = self.states[rid] = _HeadState(shadow)
                # Positions before `start` the target did not compute this time (a prefix
                # hit) are in blocks whose head KV was written when they were computed.
                feats = capture.features[row : row + end - start]
                sample = rid in want and end == req.num_tokens - 1
                feeds[rid] = _Feed(state, start, list(tokens[start + 1 : end + 1]), feats, sample)
        for req in requests:
            rid = req.request_id
            if rid not in want or rid in feeds:
                continue
            state = self.states.get(rid)
            if state is None or state.last is None or state.fed != req.num_tokens - 1:
                continue
            p = state.fed - 1
            tokens = [req.all_token_ids[p + 1]]
            feeds[rid] = _Feed(state, p, tokens, state.last[None], True)
        return list(feeds.values())

    def _run_feeds(
        self, feeds: list[_Feed], drafts: dict[str, list[int]], carry: dict[str, torch.Tensor]
    ) -> None:
        pending = list(feeds)
        while pending:
            budget = self.budget
            batch: list[tuple[_Feed, ScheduledRequest, int]] = []
            for f in pending:
                if budget <= 0:
                    break
                n = min(len(f.token_ids) - f.done, budget)
                start = f.start + f.done
                last = f.done + n == len(f.token_ids)
                step = self._schedule(
                    f.state, start, f.token_ids[f.done : f.done + n], f.sample and last
                )
                if step is None:  # cannot happen: a feed writes positions the target computed
                    f.done = len(f.token_ids)
                    continue
                batch.append((f, step, n))
                budget -= n
            if not batch:
                break
            features = torch.cat([f.features[f.done : f.done + n] for f, _, n in batch])
            for f, _, n in batch:
                f.done += n
                f.state.fed = f.start + f.done
                f.state.last = f.features[f.done - 1].clone()
            hidden = self.head.combine_hidden_states(features.to(self.runner.dtype))
            self._forward([s for _, s, _ in batch], hidden, drafts, carry)
            pending = [f for f in pending if f.done < len(f.token_ids)]

    def _draft_step(
        self,
        steps: dict[str, list[int]],
        carry: dict[str, torch.Tensor],
        want: dict[str, int],
    ) -> dict[str, list[int]]:
        """One more draft for each request in `steps`: its last draft at the next position,
        with the head's own output as the hidden state."""
        scheduled: list[ScheduledRequest] = []
        hidden: list[torch.Tensor] = []
        for rid, d in steps.items():
            state = self.states[rid]
            pos = state.fed + len(d) - 1
            step = self._schedule(state, pos, [d[-1]], True)
            if step is None:
                continue
            scheduled.append(step)
            hidden.append(carry[rid])
        if not scheduled:
            return {}
        drafts = {s.request_id: steps[s.request_id] for s in scheduled}
        self._forward(scheduled, torch.stack(hidden), drafts, carry)
        return {rid: d for rid, d in drafts.items() if len(d) < want[rid]}

    def _forward(
        self,
        scheduled: list[ScheduledRequest],
        hidden: torch.Tensor,
        drafts: dict[str, list[int]],
        carry: dict[str, torch.Tensor],
    ) -> None:
        out = SchedulerOutput(scheduled, sum(s.num_tokens for s in scheduled), [], self._finished)
        self._finished = []
        step = self.runner.prepare(out)
        if step is None:
            return
        normed, nxt = self.head.forward_head(step.input_ids, step.positions, hidden, step.attn)
        if not step.sample_req_ids:
            return
        rows = step.sample_indices
        if rows is not None:
            normed, nxt = normed.index_select(0, rows), nxt.index_select(0, rows)
        ids = self.head.draft_to_target(self.head.draft_logits(normed).argmax(dim=-1)).tolist()
        for i, (rid, token) in enumerate(zip(step.sample_req_ids, ids)):
            drafts.setdefault(rid, []).append(int(token))
            carry[rid] = nxt[i]

    def _schedule(
        self, state: _HeadState, start: int, token_ids: list[int], sample: bool
    ) -> ScheduledRequest | None:
        """The head's step for positions [start, start + len(token_ids)); None when its
        table cannot reach them (no blocks left in the scratch)."""
        rid = state.shadow.request_id
        table = self._tables.get(rid)
        is_new = table is None
        old = 0 if table is None else len(table)
        table = self._extend_table(rid, [] if table is None else table, start + len(token_ids))
        if table is None:
            return None
        self._tables[rid] = table
        new_ids = list(table) if is_new else table[old:]
        return ScheduledRequest(
            rid, token_ids, start, len(token_ids), new_ids, sample, is_new, state.shadow
        )

    def _extend_table(self, rid: str, table: list[int], num_tokens: int) -> list[int] | None:
        """`table` grown to cover `num_tokens` positions: the target's blocks as far as its
        table goes (positions it computed, or its own blocks for positions it will), then
        scratch blocks."""
        need = -(-num_tokens // self.runner.block_size)
        if len(table) >= need:
            return table
        target = self.target_kv.get_block_ids(rid) if self.target_kv.has_request(rid) else []
        table = table + target[len(table) : need]
        missing = need - len(table)
        if missing:
            end = self.num_blocks + self.num_scratch
            if self._next_scratch + missing > end:
                return None
            table += range(self._next_scratch, self._next_scratch + missing)
            self._next_scratch += missing
        return table

    def _drop(self, rid: str) -> None:
        del self.states[rid]
        self._finished.append(rid)
