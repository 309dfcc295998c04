"""Multi-turn and shared-prefix chat workloads: what prefix caching and KV-aware routing speed up.

Workloads (both seeded and built from ShareGPT records, sent to ``/v1/chat/completions``):

- ``multiturn`` (`build_conversations`): conversations with at least ``num_turns`` human turns;
  turn t sends the first t human messages (each cut to about ``max_user_tokens`` tokens) with the
  model's own answers to turns 1..t-1 between them, never the dataset's, so greedy runs are
  deterministic and two runs can be compared answer by answer. Turn t's prompt extends turn
  t-1's prompt and answer: a prefix cache holds all of it but the new user message.
- ``shared-prefix`` (`build_shared_prefix`): ``num_groups`` long system prompts (~``system_tokens``
  tokens of ShareGPT answers each) x ``users_per_group`` distinct questions, single-turn, sent in a
  seeded shuffled order so requests of one group interleave with the others'.

Every request streams (``stream_options.include_usage``), greedy (``temperature: 0``), with a
fixed ``max_tokens``. Lifecycle of a run (`run_workload`):

1. Warm-up: ``warmup`` short random-word requests at once (not measured, not in the report).
2. Counters snapshot (``GET /admin/workers?stats=1``, summed per role, a missing counter is 0).
3. multiturn: turn 1 of every conversation (at most ``concurrency`` in flight), all finish, a
   snapshot, then turn 2, ... A conversation whose turn failed skips its later turns (recorded as
   failed). shared-prefix: every request (at most ``concurrency`` in flight), then a snapshot.
4. Report rows (`summarize`): per turn and "turns >= 2" (multiturn) or "all" (shared-prefix):
   requests, errors, TTFT p50/p90 and latency p50 (ms, successful requests), prefill prefix hit
   rate = delta ``prefix_hit_tokens`` / delta ``prompt_tokens``, decode hit rate = delta
   ``prefix_hit_blocks`` / delta ``prefix_lookup_blocks`` (None when nothing was looked up), and
   delta ``kv_bytes_sent`` / ``kv_bytes_skipped`` per request (bytes), and delta
   ``warmup_tokens_computed`` per request (tokens prefill workers computed into their cache in
   warm-ups after requests finished, off the requests' critical path).

The result dict is JSON-able; ``outputs`` maps ``"<conversation>/<turn>"`` to the answer text.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import asdict, dataclass

import httpx
import numpy as np

from loadtest.client import RequestOutput, send_request
from loadtest.datasets import random_requests
from loadtest.errors import DatasetError, LoadTestError, ServerError
from loadtest.report import write_json
from loadtest.sharegpt import GPT_ROLES, HUMAN_ROLES

CHARS_PER_TOKEN = 4  # loadtest.sample.approx_token_count's estimate
WORKLOADS = ("multiturn", "shared-prefix")
COUNTERS = {"prefill": ("prompt_tokens", "prefix_hit_tokens", "kv_bytes_sent", "kv_bytes_skipped",
                        "warmup_tokens_computed"),
            "decode": ("prefix_hit_blocks", "prefix_lookup_blocks", "cache_evictions")}
SKIPPED = "skipped: an earlier turn of this conversation failed"


@dataclass(frozen=True)
class Conversation:
    """One multi-turn conversation: its human messages, one per turn."""

    id: str
    """``"c<i>"``, i = position in the seeded order (same seed, same ids)."""
    source_id: str
    """The ShareGPT record's ``id`` (may be empty)."""
    user_messages: tuple[str, ...]


@dataclass(frozen=True)
class SharedPrefixRequest:
    """One single-turn request of the shared-prefix workload."""

    id: str
    """``"g<group>u<user>"``."""
    group: int
    system: str
    """The group's system prompt (identical, character for character, within a group)."""
    question: str

    def messages(self) -> list[dict]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.question}]


def truncate_tokens(text: str, max_tokens: int) -> str:
    """``text`` cut to about ``max_tokens`` tokens (4 characters each), at a space when one is
    in the last quarter of the cut; unchanged when it is short enough."""
    limit = max_tokens * CHARS_PER_TOKEN
    if len(text) <= limit:
        return text
    cut = text[:limit]
    space = cut.rfind(" ")
    return cut[:space] if space >= limit * 3 // 4 else cut


def messages_of(record: object, roles: tuple[str, ...]) -> list[str]:
    """The non-blank message texts of ``record`` from ``roles``, in order."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    return [t["value"] for t in turns or () if isinstance(t, dict) and t.get("from") in roles
            and isinstance(t.get("value"), str) and t["value"].strip()]


def build_conversations(records: list, num_conversations: int, num_turns: int, seed: int = 0,
                        max_user_tokens: int = 256) -> list[Conversation]:
    """``num_conversations`` conversations of ``num_turns`` human messages (each cut to about
    ``max_user_tokens`` tokens), from ``records`` shuffled with ``seed``.

    Raises ``DatasetError`` if fewer records have ``num_turns`` non-blank human messages."""
    if num_conversations < 1 or num_turns < 1 or max_user_tokens < 1:
        raise DatasetError("num_conversations, num_turns and max_user_tokens must be >= 1")
    pool = list(records)
    random.Random(seed).shuffle(pool)
    out: list[Conversation] = []
    for record in pool:
        human = messages_of(record, HUMAN_ROLES)
        if len(human) >= num_turns:
            msgs = tuple(truncate_tokens(m, max_user_tokens) for m in human[:num_turns])
            out.append(Conversation(f"c{len(out)}", str(record.get("id", "")), msgs))
            if len(out) == num_conversations:
                return out
    raise DatasetError(f"only {len(out)} conversations have {num_turns} human turns "
                       f"({num_conversations} asked)")


def turn_messages(conversation: Conversation, turn: int, answers: list[str]) -> list[dict]:
    """The chat messages of ``turn`` (1-based): user 1, answer 1, ..., user ``turn``, where
    ``answers[i]`` is the model's answer to turn i + 1 (at least ``turn - 1`` of them)."""
    if not 1 <= turn <= len(conversation.user_messages) or len(answers) < turn - 1:
        raise ValueError(f"turn {turn} needs {turn - 1} answers, got {len(answers)}")
    messages = []
    for i in range(turn):
        messages.append({"role": "user", "content": conversation.user_messages[i]})
        if i < turn - 1:
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


def build_shared_prefix(records: list, num_groups: int, users_per_group: int,
                        system_tokens: int = 400, seed: int = 0,
                        max_user_tokens: int = 128) -> list[SharedPrefixRequest]:
    """``num_groups`` x ``users_per_group`` requests in a seeded random order. Group g's system
    prompt is a header naming g followed by ShareGPT answers (records no other group uses) up to
    about ``system_tokens`` tokens; questions are distinct first human turns of other records.

    Raises ``DatasetError`` if ``records`` hold too little text."""
    if min(num_groups, users_per_group, system_tokens, max_user_tokens) < 1:
        raise DatasetError("num_groups, users_per_group, system_tokens, max_user_tokens must be >= 1")
    pool = list(records)
    random.Random(seed).shuffle(pool)
    systems, used = [], 0
    for g in range(num_groups):
        text = f"You are assistant number {g + 1}. Answer the user with the help of these notes.\n\n"
        while len(text) < system_tokens * CHARS_PER_TOKEN and used < len(pool):
            text += "\n\n".join(messages_of(pool[used], GPT_ROLES)) + "\n\n"
            used += 1
        if len(text) < system_tokens * CHARS_PER_TOKEN:
            raise DatasetError(f"not enough answer text for {num_groups} system prompts")
        systems.append(truncate_tokens(text, system_tokens))
    questions: list[str] = []
    for record in pool[used:]:
        human = messages_of(record, HUMAN_ROLES)
        q = truncate_tokens(human[0], max_user_tokens) if human else ""
        if q and q not in questions:
            questions.append(q)
        if len(questions) == num_groups * users_per_group:
            break
    else:
        raise DatasetError(f"only {len(questions)} distinct questions "
                           f"({num_groups * users_per_group} needed)")
    out = [SharedPrefixRequest(f"g{g}u{u}", g, systems[g], questions[g * users_per_group + u])
           for g in range(num_groups) for u in range(users_per_group)]
    random.Random(seed + 1).shuffle(out)
    return out


# -- counters and report math (pure) ------------------------------------------------------------
def sum_counters(workers: list[dict]) -> dict:
    """``/admin/workers?stats=1`` JSON -> ``{"prefill": {name: sum}, "decode": {...},
    "errors": [worker id: why]}`` over the `COUNTERS` names (a missing counter counts 0)."""
    out: dict = {role: dict.fromkeys(names, 0.0) for role, names in COUNTERS.items()}
    out["errors"] = []
    for w in workers:
        stats, role = w.get("stats") or {}, w.get("role")
        if "error" in stats or "counters" not in stats:
            out["errors"].append(f"{w.get('id')}: {stats.get('error', 'no stats')}")
        elif role in COUNTERS:
            for name in COUNTERS[role]:
                out[role][name] += float(stats["counters"].get(name, 0.0))
    return out


def counter_delta(before: dict, after: dict) -> dict:
    """``after - before`` per role and counter (both from `sum_counters`)."""
    return {role: {n: after[role][n] - before[role][n] for n in names}
            for role, names in COUNTERS.items()}


def ratio(num: float, den: float) -> float | None:
    """``num / den``, None when ``den`` is 0."""
    return num / den if den else None


def percentile_ms(values_s: list[float], p: float) -> float | None:
    """The ``p``-th percentile (numpy's linear) of ``values_s`` (seconds) in ms; None if empty."""
    return float(np.percentile(values_s, p)) * 1000 if values_s else None


def summarize(label: str, records: list[dict], delta: dict) -> dict:
    """One report row over ``records`` (per-request dicts, see `request_record`) and the counter
    ``delta`` (`counter_delta`) of the same span; times in ms, bytes per request."""
    ok = [r for r in records if not r["error"]]
    n, pre, dec = len(records), delta["prefill"], delta["decode"]
    return {"label": label, "requests": n, "errors": n - len(ok),
            "ttft_p50_ms": percentile_ms([r["ttft_s"] for r in ok], 50),
            "ttft_p90_ms": percentile_ms([r["ttft_s"] for r in ok], 90),
            "latency_p50_ms": percentile_ms([r["latency_s"] for r in ok], 50),
            "prompt_tokens_mean": float(np.mean([r["prompt_tokens"] for r in ok])) if ok else None,
            "prefill_hit_rate": ratio(pre["prefix_hit_tokens"], pre["prompt_tokens"]),
            "decode_hit_rate": ratio(dec["prefix_hit_blocks"], dec["prefix_lookup_blocks"]),
            "kv_bytes_sent_per_request": ratio(pre["kv_bytes_sent"], n),
            "kv_bytes_skipped_per_request": ratio(pre["kv_bytes_skipped"], n),
            "warmup_tokens_per_request": ratio(pre["warmup_tokens_computed"], n),
            "cache_evictions": dec["cache_evictions"]}


def multiturn_rows(records: list[dict], snapshots: list[dict]) -> list[dict]:
    """A row per turn (``snapshots[t-1]`` -> ``snapshots[t]``) and "turns >= 2" (``snapshots[1]``
    -> the last); ``snapshots[0]`` is taken before turn 1."""
    turns = len(snapshots) - 1
    rows = [summarize(f"turn {t}", [r for r in records if r["turn"] == t],
                      counter_delta(snapshots[t - 1], snapshots[t])) for t in range(1, turns + 1)]
    if turns >= 2:
        rows.append(summarize("turns >= 2", [r for r in records if r["turn"] >= 2],
                              counter_delta(snapshots[1], snapshots[-1])))
    return rows


COLUMNS = (("requests", "requests", "{:d}"), ("errors", "errors", "{:d}"),
           ("TTFT p50 ms", "ttft_p50_ms", "{:.0f}"), ("TTFT p90 ms", "ttft_p90_ms", "{:.0f}"),
           ("lat p50 ms", "latency_p50_ms", "{:.0f}"), ("prompt tok", "prompt_tokens_mean", "{:.0f}"),
           ("P hit", "prefill_hit_rate", "{:.1%}"), ("D hit", "decode_hit_rate", "{:.1%}"),
           ("KV sent/req", "kv_bytes_sent_per_request", "{:,.0f}"),
           ("KV skip/req", "kv_bytes_skipped_per_request", "{:,.0f}"),
           ("warm tok/req", "warmup_tokens_per_request", "{:.0f}"))


def cell(value: object, fmt: str) -> str:
    """``value`` formatted with ``fmt``; "-" for None."""
    return "-" if value is None else fmt.format(value)


def table_lines(rows: list[dict], title: str = "") -> list[str]:
    """The rows as a plain-text table (P hit: prefill prefix hit rate; D hit: decode's)."""
    widths = [max(len(h), 9) for h, _, _ in COLUMNS]
    first = max([12] + [len(r["label"]) + 1 for r in rows])
    lines = [title] if title else []
    lines.append(" " * first + " ".join(f"{h:>{w}}" for (h, _, _), w in zip(COLUMNS, widths)))
    for row in rows:
        lines.append(f"{row['label']:<{first}}" + " ".join(
            f"{cell(row[key], fmt):>{w}}" for (_, key, fmt), w in zip(COLUMNS, widths)))
    return lines


# -- running against a server -------------------------------------------------------------------
def request_record(conversation: str, turn: int, output: RequestOutput) -> dict:
    """The per-request dict of the report (seconds, tokens; ``error`` empty on success)."""
    return {"conversation": conversation, "turn": turn, "ttft_s": output.ttft,
            "latency_s": output.latency, "prompt_tokens": output.prompt_len,
            "output_tokens": output.output_tokens, "text": output.generated_text,
            "error": "" if output.success else (output.error or "failed")}


class Session:
    """An HTTP client to one router: chat requests and counter snapshots."""

    def __init__(self, base_url: str, model: str, max_tokens: int, concurrency: int,
                 timeout_s: float = 300.0):
        self.base_url, self.model, self.max_tokens = base_url.rstrip("/"), model, max_tokens
        self.slots = asyncio.Semaphore(concurrency)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), trust_env=False,
                                        limits=httpx.Limits(max_connections=concurrency + 2))

    async def chat(self, messages: list[dict], max_tokens: int | None = None) -> RequestOutput:
        """Stream one greedy chat completion (waits for a free slot); never raises for a
        server or network failure (``success`` False, ``error`` says why)."""
        body = {"model": self.model, "messages": messages, "stream": True, "temperature": 0,
                "max_tokens": max_tokens or self.max_tokens, "stream_options": {"include_usage": True}}
        async with self.slots:
            return await send_request(self.client, f"{self.base_url}/v1/chat/completions", body,
                                      RequestOutput())

    async def counters(self) -> dict:
        """`sum_counters` of the router's ``/admin/workers?stats=1``. Raises ``ServerError``."""
        try:
            response = await self.client.get(f"{self.base_url}/admin/workers", params={"stats": 1})
            response.raise_for_status()
            return sum_counters(response.json())
        except (httpx.HTTPError, ValueError) as exc:
            raise ServerError(f"cannot read worker counters from {self.base_url}: {exc}") from exc

    async def warm_up(self, count: int, seed: int) -> None:
        """``count`` short random-word requests at once; raises ``ServerError`` if one fails."""
        prompts = random_requests(count, 24, 8, seed=seed + 10_000) if count else []
        outs = await asyncio.gather(*(self.chat([{"role": "user", "content": p.prompt}], 8)
                                      for p in prompts))
        failed = [o.error for o in outs if not o.success]
        if failed:
            raise ServerError(f"warm-up against {self.base_url} failed: {failed[0]}")

    async def close(self) -> None:
        await self.client.aclose()


async def run_multiturn(session: Session, conversations: list[Conversation]) -> tuple[list, list]:
    """Turn-synchronous run; returns (per-request records, snapshots before turn 1 and after
    every turn)."""
    answers: dict[str, list[str]] = {c.id: [] for c in conversations}
    failed: set[str] = set()
    records, snapshots = [], [await session.counters()]

    async def one(conv: Conversation, turn: int) -> dict:
        if conv.id in failed:
            return request_record(conv.id, turn, RequestOutput(error=SKIPPED))
        out = await session.chat(turn_messages(conv, turn, answers[conv.id]))
        return request_record(conv.id, turn, out)

    for turn in range(1, max(len(c.user_messages) for c in conversations) + 1):
        done = await asyncio.gather(*(one(c, turn) for c in conversations))
        for rec in done:
            (failed.add(rec["conversation"]) if rec["error"]
             else answers[rec["conversation"]].append(rec["text"]))
        records += done
        snapshots.append(await session.counters())
    return records, snapshots


async def run_shared_prefix(session: Session, requests: list[SharedPrefixRequest]) -> tuple[list, list]:
    """Every request, at most the session's concurrency in flight; (records, [before, after])."""
    before = await session.counters()

    async def one(req: SharedPrefixRequest) -> dict:
        return request_record(req.id, 1, await session.chat(req.messages()))

    records = list(await asyncio.gather(*(one(r) for r in requests)))
    return records, [before, await session.counters()]


async def run_workload(base_url: str, workload: str, items: list, *, model: str,
                       max_tokens: int = 32, concurrency: int = 4, warmup: int = 2,
                       seed: int = 0, timeout_s: float = 300.0) -> dict:
    """Run ``items`` (conversations or shared-prefix requests) and return the result dict
    (module docstring). Raises ``ServerError`` if the warm-up or a counter read fails."""
    if workload not in WORKLOADS:
        raise LoadTestError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    session = Session(base_url, model, max_tokens, concurrency, timeout_s)
    try:
        await session.warm_up(warmup, seed)
        start = time.perf_counter()
        run = run_multiturn if workload == "multiturn" else run_shared_prefix
        records, snapshots = await run(session, items)
        duration = time.perf_counter() - start
    finally:
        await session.close()
    rows = (multiturn_rows(records, snapshots) if workload == "multiturn"
            else [summarize("all", records, counter_delta(snapshots[0], snapshots[-1]))])
    return {"workload": workload, "base_url": base_url, "model": model, "max_tokens": max_tokens,
            "concurrency": concurrency, "seed": seed, "duration_s": duration, "rows": rows,
            "outputs": {f"{r['conversation']}/{r['turn']}": r["text"] for r in records},
            "requests": records, "counters": snapshots,
            "items": [asdict(i) for i in items]}


# -- CLI ----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.multiturn", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True, help="router root, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name (default: first of the server's /v1/models)")
    p.add_argument("--workload", choices=WORKLOADS, default="multiturn")
    p.add_argument("--num-conversations", type=int, default=8)
    p.add_argument("--num-turns", type=int, default=4)
    p.add_argument("--max-user-tokens", type=int,
                   help="per user message, approx. (default 256 multiturn, 128 shared-prefix)")
    p.add_argument("--num-groups", type=int, default=4)
    p.add_argument("--users-per-group", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=400, help="per system prompt (approx.)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at most")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0, help="s")
    p.add_argument("--out", help="write the result JSON here")
    return p


def build_items(args: argparse.Namespace, records: list) -> list:
    """The workload ``args`` describe, from ``records``. Raises ``DatasetError``."""
    if args.workload == "multiturn":
        return build_conversations(records, args.num_conversations, args.num_turns, args.seed,
                                   args.max_user_tokens or 256)
    return build_shared_prefix(records, args.num_groups, args.users_per_group, args.system_tokens,
                               args.seed, args.max_user_tokens or 128)


def main(argv: list[str] | None = None) -> int:
    from loadtest.cli import first_model
    from loadtest.sharegpt import load_records

    args = build_parser().parse_args(argv)
    try:
        model = args.model or first_model(args.base_url, {}, args.request_timeout)
        items = build_items(args, load_records())
        result = asyncio.run(run_workload(
            args.base_url, args.workload, items, model=model, max_tokens=args.max_tokens,
            concurrency=args.concurrency, warmup=args.warmup, seed=args.seed,
            timeout_s=args.request_timeout))
    except LoadTestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print("\n".join(table_lines(result["rows"], f"{args.workload} against {args.base_url} "
                                                f"({result['duration_s']:.1f} s)")))
    for error in sorted({e for snap in result["counters"] for e in snap["errors"]}):
        print(f"warning: worker stats unreadable, counters incomplete: {error}", file=sys.stderr)
    if args.out:
        print(f"result written to {write_json(result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
