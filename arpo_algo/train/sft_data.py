"""SFT data: demonstrations from ToolMath or LLaMA-Factory files, parsed into masked segments and tokenized.

The formats, the masking of inline ``<result>`` spans and the token layout are described in :mod:`arpo_algo.train.sft`
(the training loop); this module turns records into ``(ids, labels)`` rows.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arpo_algo.rollout import layout
from arpo_base.errors import ArpoError, ConfigError

#: The RL environment's insertion format (docs/concepts/reference-choices.md#interaction-protocol).
RESULT_TEMPLATE = " <result>\n{result}\n</result>"
_RESULT_SPAN = re.compile(r"\s*<result>.*?</result>", re.DOTALL)
Segment = tuple[str, bool]


# --------------------------------------------------------------------------------------------------- data


@dataclass
class SFTExample:
    """One demonstration: prompt chat messages (masked) and the assistant reply as ``(text, trained)`` segments."""

    messages: list[dict[str, str]]
    segments: list[Segment]
    source: str = ""


def split_inline_results(text: str) -> list[Segment]:
    """Split assistant text into trained text and masked ``<result>…</result>`` spans (with leading whitespace)."""
    segments: list[Segment] = []
    pos = 0
    for m in _RESULT_SPAN.finditer(text):
        if m.start() > pos:
            segments.append((text[pos : m.start()], True))
        segments.append((m.group(0), False))
        pos = m.end()
    rest = text[pos:]
    if "<result>" in rest:
        raise ValueError("an assistant reply has <result> without a closing </result>")
    if rest:
        segments.append((rest, True))
    return segments


def _role(turn: dict, i: int) -> tuple[str, str]:
    if "from" in turn and "value" in turn:
        role, value = turn["from"], turn["value"]
    elif "role" in turn and "content" in turn:
        role, value = turn["role"], turn["content"]
    else:
        raise ValueError(f"turn {i} has neither from/value nor role/content keys (keys: {sorted(turn)})")
    mapped = {
        "human": "user",
        "user": "user",
        "gpt": "assistant",
        "assistant": "assistant",
        "system": "system",
        "observation": "observation",
        "tool": "observation",
        "function_call": "function_call",
    }
    if role not in mapped or not isinstance(value, str):
        raise ValueError(f"turn {i}: unknown role {role!r} or non-string value")
    return mapped[role], value


def parse_sharegpt(record: dict) -> tuple[list[dict[str, str]], list[Segment]]:
    """One sharegpt record -> (prompt messages, segments of the last assistant turn)."""
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list) or not turns:
        raise ValueError("sharegpt record needs a non-empty 'conversations' list")
    parsed = [_role(t, i) if isinstance(t, dict) else (None, None) for i, t in enumerate(turns)]
    if any(r is None for r, _ in parsed):
        raise ValueError("every conversation turn must be an object")
    messages: list[dict[str, str]] = []
    if isinstance(record.get("system"), str) and record["system"]:
        messages.append({"role": "system", "content": record["system"]})
    last_user = max((i for i, (r, _) in enumerate(parsed) if r == "user"), default=None)
    if last_user is None:
        raise ValueError("sharegpt record has no human turn")
    for role, value in parsed[: last_user + 1]:  # history: plain chat messages, all masked
        messages.append({"role": "assistant" if role in ("function_call", "observation") else role, "content": value})
    reply = parsed[last_user + 1 :]
    if not reply or reply[-1][0] != "assistant":
        raise ValueError("sharegpt record must end with a gpt turn after its last human turn")
    segments: list[Segment] = []
    for role, value in reply:
        if role == "observation":
            text = value if "<result>" in value else RESULT_TEMPLATE.format(result=value)
            segments.append((text, False))
        elif role in ("assistant", "function_call"):
            segments.extend(split_inline_results(value))
        else:
            raise ValueError(f"unexpected {role!r} turn inside the assistant reply")
    return messages, segments


def parse_alpaca(record: dict) -> tuple[list[dict[str, str]], list[Segment]]:
    """One alpaca record -> (prompt messages, segments of ``output``)."""
    for key in ("instruction", "output"):
        if not isinstance(record.get(key), str):
            raise ValueError(f"alpaca record needs a string {key!r}")
    messages: list[dict[str, str]] = []
    if isinstance(record.get("system"), str) and record["system"]:
        messages.append({"role": "system", "content": record["system"]})
    for pair in record.get("history") or []:
        if not (isinstance(pair, list | tuple) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise ValueError("alpaca 'history' must be a list of [query, response] string pairs")
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    extra = record.get("input") or ""
    # LLaMA-Factory joins instruction and input with a newline.
    messages.append({"role": "user", "content": record["instruction"] + ("\n" + extra if extra else "")})
    return messages, split_inline_results(record["output"])


def detect_format(record: Any) -> str | None:
    """``"sharegpt"``, ``"alpaca"`` or None for one record."""
    if isinstance(record, dict) and isinstance(record.get("conversations", record.get("messages")), list):
        return "sharegpt"
    if isinstance(record, dict) and "instruction" in record and "output" in record:
        return "alpaca"
    return None


def load_file_examples(path: str | Path, data_format: str = "auto", limit: int | None = None) -> list[SFTExample]:
    """Read a sharegpt/alpaca JSON (list) or JSONL file; errors name the file and the first bad record."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ArpoError(f"SFT data file not found: {path}", hint='use data="toolmath" or a sharegpt/alpaca JSON file')
    text = path.read_text(encoding="utf-8")
    try:
        records = json.loads(text)
    except json.JSONDecodeError:
        try:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is neither a JSON list nor JSON lines: {e}") from e
    if not isinstance(records, list) or not records:
        raise ConfigError(f"{path}: expected a non-empty JSON list of records (sharegpt or alpaca)")
    records = records[:limit] if limit else records
    fmt = detect_format(records[0]) if data_format == "auto" else data_format
    if fmt is None:
        raise ConfigError(
            f"{path}: record 0 is in no known SFT format: {json.dumps(records[0])[:200]}",
            hint="sharegpt records have a 'conversations' list; alpaca records have 'instruction' and 'output'",
        )
    parse = parse_sharegpt if fmt == "sharegpt" else parse_alpaca
    out = []
    for i, rec in enumerate(records):
        try:
            if not isinstance(rec, dict):
                raise ValueError("record is not a JSON object")
            messages, segments = parse(rec)
        except ValueError as e:
            raise ConfigError(
                f"{path}: record {i} is not valid {fmt}: {e}", hint=f"record {i}: {json.dumps(rec)[:200]}"
            ) from e
        out.append(SFTExample(messages, segments, source=f"{path.name}[{i}]"))
    return out


def load_examples(cfg: Any) -> list[SFTExample]:
    """The demonstrations an :class:`~arpo_algo.train.sft.SFTConfig` names (ToolMath or a file)."""
    if cfg.data != "toolmath":
        return load_file_examples(cfg.data, cfg.data_format, cfg.num_examples)
    from arpo_env.demonstrations import toolmath_demonstrations

    kwargs: dict[str, Any] = {"seed": cfg.seed, "split": "train"}
    if cfg.levels is not None:
        kwargs["levels"] = cfg.levels
    if cfg.persistent_python:  # replayed through a persistent interpreter, in the form that relies on it
        kwargs["env_config"] = {"tools": {"python": {"persistent": True}}}
    demos = toolmath_demonstrations(cfg.num_examples or 256, **kwargs)
    return [
        SFTExample(list(d["messages"]), [(t, bool(m)) for t, m in d["segments"]], source=f"toolmath[{i}]")
        for i, d in enumerate(demos)
    ]


# ---------------------------------------------------------------------------------------------- tokenize


def tokenize_example(tokenizer: Any, ex: SFTExample) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 = masked) in the RL sampler's layout: prompt, segments, eos."""
    prompt = layout.prompt_ids(tokenizer, ex.messages)
    ids, labels = list(prompt), [-100] * len(prompt)
    for text, trained in ex.segments:
        # tool output goes through the RL rule (it can never produce special tokens)
        seg = layout.text_ids(tokenizer, text) if trained else layout.observation_ids(tokenizer, text)
        ids += seg
        labels += seg if trained else [-100] * len(seg)
    if tokenizer.eos_token_id is None:
        raise ArpoError(
            "the tokenizer has no eos_token, so SFT cannot teach the model to stop",
            hint="set eos_token in the model folder's tokenizer_config.json",
        )
    ids.append(tokenizer.eos_token_id)
    labels.append(tokenizer.eos_token_id)
    return ids, labels


def build_dataset(
    tokenizer: Any, examples: list[SFTExample], max_seq_len: int, truncation: str
) -> tuple[list[tuple[list[int], list[int]]], dict[str, int]]:
    """Tokenize all examples and apply the length policy; returns (rows, counts)."""
    rows, counts = [], {"examples": len(examples), "dropped_too_long": 0, "truncated": 0, "dropped_no_target": 0}
    for ex in examples:
        ids, labels = tokenize_example(tokenizer, ex)
        if len(ids) > max_seq_len:
            if truncation == "drop":
                counts["dropped_too_long"] += 1
                continue
            ids, labels = ids[:max_seq_len], labels[:max_seq_len]
            counts["truncated"] += 1
        if all(lab == -100 for lab in labels[1:]):  # nothing left to learn (e.g. the prompt fills max_seq_len)
            counts["dropped_no_target"] += 1
            continue
        rows.append((ids, labels))
    if not rows:
        raise ConfigError(
            f"no SFT example fits max_seq_len={max_seq_len} ({counts})",
            hint='raise max_seq_len or use truncation="truncate"',
        )
    counts["kept"] = len(rows)
    return rows, counts
