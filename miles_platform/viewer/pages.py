"""The viewer's HTML, rendered on the server: f-strings with every value through `html.escape`, one
stylesheet, two lines of script (the run picker submits on change; the hovered token's values show
above the response), nothing fetched from a network."""

from __future__ import annotations

import html
import math
from typing import Any
from urllib.parse import urlencode

from miles_platform.viewer.queries import MAX_PAGE_SIZE, SORTS, STATUSES, SampleQuery
from miles_platform.viewer.tokens import SHADES, TokenValues, routed_experts_of, shade_color, shade_scale

e = html.escape

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0; color: #1d2330; background: #f6f7f9; }
header { background: #24292f; color: #fff; padding: 8px 16px; display: flex; gap: 16px; align-items: baseline; }
header a { color: #fff; font-weight: 600; text-decoration: none; } header .root { color: #aab; font-size: 12px; }
main { padding: 12px 16px; } a { color: #0a58ca; }
table { border-collapse: collapse; background: #fff; } td, th { border-bottom: 1px solid #e3e5e8;
  padding: 4px 8px; text-align: left; vertical-align: top; } th { background: #eef0f3; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; } td.snip { max-width: 420px;
  overflow: hidden; text-overflow: ellipsis; white-space: nowrap; font-family: ui-monospace, monospace; font-size: 12px; }
form.filters { display: flex; flex-wrap: wrap; gap: 6px 14px; background: #fff; padding: 10px; border: 1px solid #e3e5e8;
  margin-bottom: 10px; align-items: end; } form.filters label { display: flex; flex-direction: column; font-size: 12px; color: #555; }
form.filters input[type=number] { width: 6.5em; } form.filters input.where { width: 28em; font-family: ui-monospace, monospace; }
.error { background: #fde7e9; border: 1px solid #e5a0a6; padding: 8px 12px; margin: 8px 0; }
.pager { margin: 8px 0; display: flex; gap: 14px; align-items: baseline; }
.facts td:first-child { color: #555; } .box { background: #fff; border: 1px solid #e3e5e8; padding: 10px; margin: 10px 0; }
.text, .tokens { white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 13px; word-break: break-word; }
.tok { border-radius: 2px; } .tok.clip { text-decoration: underline wavy #b00; } .tok.nov { text-decoration: underline dotted #999; }
.turn { border-left: 3px solid #0a58ca; padding: 4px 8px; margin: 6px 0; } .turn.tool { border-color: #888; background: #fafafa; }
.turn .role { font-size: 12px; color: #555; font-weight: 600; }
.shades a { margin-right: 10px; } .shades a.on { font-weight: 700; color: #1d2330; text-decoration: none; }
.group { display: flex; flex-wrap: wrap; gap: 8px; } .card { background: #fff; border: 1px solid #d8dbe0; padding: 6px 8px;
  width: 230px; font-size: 12px; } .card.me { border: 2px solid #0a58ca; } .card .snip { font-family: ui-monospace, monospace;
  white-space: pre-wrap; max-height: 9em; overflow: hidden; }
.grid { display: flex; flex-wrap: wrap; gap: 8px; } .grid figure { margin: 0; background: #fff; border: 1px solid #e3e5e8;
  padding: 4px; font-size: 11px; text-align: center; } .grid img { width: 128px; height: 128px; image-rendering: pixelated; }
.tokinfo { font: 12px ui-monospace, monospace; color: #333; background: #eef0f3; padding: 2px 6px; margin: 4px 0;
  min-height: 1.4em; }
img.big { width: 256px; image-rendering: pixelated; border: 1px solid #ccc; }
"""


def href(path: str, **params: Any) -> str:
    return path + ("?" + urlencode({k: v for k, v in params.items() if v is not None}) if params else "")


def layout(title: str, body: str, root: str) -> str:
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{e(title)} · miles viewer</title>'
        f'<style>{CSS}</style></head><body><header><a href="/">miles-platform viewer</a>'
        f'<span class="root">{e(root)}</span></header><main>{body}</main></body></html>'
    )


def error_box(message: str) -> str:
    return f'<div class="error" id="error">{e(message)}</div>'


def fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.{digits}g}" if math.isfinite(v) else str(v)
    return str(v)


# ---------------------------------------------------------------------- runs


def runs_page(runs: list[dict[str, Any]], root: str) -> str:
    if not runs:
        return layout("runs", "<p>No rollouts under this storage root yet.</p>", root)
    rows = "".join(
        f'<tr><td><a href="{e(href("/samples", run=r["run"]))}">{e(r["run"])}</a></td>'
        f'<td class="num">{r["samples"]}</td><td class="num">{r["rollouts"]}</td>'
        f'<td class="num">{r["first_rollout"]}–{r["last_rollout"]}</td></tr>'
        for r in runs
    )
    body = (
        "<h2>Runs</h2><table><tr><th>run</th><th>samples</th><th>rollouts</th><th>rollout ids</th></tr>"
        f"{rows}</table>"
    )
    return layout("runs", body, root)


# ---------------------------------------------------------------------- the sample list


def _select(name: str, options: list[tuple[str, str]], chosen: str, attrs: str = "") -> str:
    opts = "".join(
        f'<option value="{e(v)}"{" selected" if v == chosen else ""}>{e(label)}</option>'
        for v, label in options
    )
    return f'<select name="{name}" {attrs}>{opts}</select>'


def _number(name: str, label: str, value: Any, step: str = "any") -> str:
    v = "" if value is None else e(str(value))
    return f'<label>{label}<input type="number" name="{name}" value="{v}" step="{step}"></label>'


def filter_form(q: SampleQuery, runs: list[str], versions: list[dict[str, Any]]) -> str:
    run_opts = [(r, r) for r in runs]
    version_opts = [("", "any")] + [
        (str(v["version"]), f"v{v['version']} (rollout {v['rollout_id']}, reward {fmt(v['mean_reward'], 3)})")
        for v in versions
    ]
    sort_opts = [(k, k.replace("_", " ")) for k in SORTS]
    fields = [
        f"<label>run{_select('run', run_opts, q.run, 'onchange=this.form.submit()')}</label>",
        f"<label>version{_select('version', version_opts, '' if q.version is None else str(q.version))}</label>",
        _number("rollout_from", "rollout from", q.rollout_from, "1"),
        _number("rollout_to", "rollout to", q.rollout_to, "1"),
        _number("min_reward", "reward ≥", q.min_reward),
        _number("max_reward", "reward ≤", q.max_reward),
        f"<label>status{_select('status', [('', 'any')] + [(s, s) for s in STATUSES], q.status)}</label>",
        f"<label>truncated{_select('truncated', [('', 'any'), ('yes', 'yes'), ('no', 'no')], q.truncated)}</label>",
        _number("min_len", "length ≥", q.min_len, "1"),
        _number("max_len", "length ≤", q.max_len, "1"),
        f'<label>where (SQL over rollouts)<input class="where" name="where" value="{e(q.where)}" '
        "placeholder=\"json_extract_string(metadata, '$.source') = 'gsm8k'\"></label>",
        f"<label>sort{_select('sort', sort_opts, q.sort)}</label>",
        f"<label>order{_select('desc', [('', 'ascending'), ('1', 'descending')], '1' if q.desc else '')}</label>",
        f"<label>per page{_select('page_size', [(str(n), str(n)) for n in (20, 50, 100, MAX_PAGE_SIZE)], str(q.page_size))}</label>",
        '<button type="submit" id="apply">Apply</button>',
        f'<a href="{e(href("/samples", run=q.run))}">reset</a>',
    ]
    return f'<form class="filters" method="get" action="/samples">{"".join(fields)}</form>'


def _sample_href(run: str, rollout_id: int, index: int, shade: str | None = None) -> str:
    return href("/sample", run=run, rollout_id=rollout_id, index=index, shade=shade)


def _image_src(run: str, rollout_id: int, index: int) -> str:
    return href("/image", run=run, rollout_id=rollout_id, index=index)


def samples_page(
    q: SampleQuery,
    runs: list[str],
    versions: list[dict[str, Any]],
    total: int,
    rows: list[dict[str, Any]],
    root: str,
    images: bool = False,
    error: str | None = None,
) -> str:
    """The filter form, the pager and one page of samples: a table, or for a diffusion run (`images`)
    a grid of its images."""
    parts = [filter_form(q, runs, versions)]
    if error:
        parts.append(error_box(error))
    pages = max(1, math.ceil(total / q.page_size))
    prev = f'<a href="{e(href("/samples", **q.params(page=q.page - 1)))}">‹ prev</a>' if q.page > 1 else ""
    nxt = (
        f'<a id="next" href="{e(href("/samples", **q.params(page=q.page + 1)))}">next ›</a>'
        if q.page < pages
        else ""
    )
    parts.append(
        f'<div class="pager"><span id="total">{total} samples</span><span>page {q.page} / {pages}</span>{prev}{nxt}</div>'
    )
    if images:
        figs = "".join(
            f'<figure><a class="sample-link" href="{e(_sample_href(r["run"], r["rollout_id"], r["index"]))}">'
            f'<img src="{e(_image_src(r["run"], r["rollout_id"], r["index"]))}" alt="sample {r["index"]}"></a>'
            f"<figcaption>r{r['rollout_id']} #{r['index']} · {fmt(r['reward'], 3)}</figcaption></figure>"
            for r in rows
        )
        parts.append(f'<div class="grid">{figs}</div>')
    else:
        head = (
            "<tr><th>rollout</th><th>index</th><th>group</th><th>reward</th><th>status</th><th>length</th>"
            "<th>mean lp</th><th>versions</th><th>prompt</th><th>response</th></tr>"
        )
        body = "".join(_list_row(r) for r in rows)
        parts.append(f'<table id="samples">{head}{body}</table>')
    return layout(f"{q.run} samples", "".join(parts), root)


def _list_row(r: dict[str, Any]) -> str:
    link = e(_sample_href(r["run"], r["rollout_id"], r["index"]))
    turns = f" · {r['turns']} turns" if r.get("turns") else ""
    return (
        f'<tr class="sample"><td class="num">{r["rollout_id"]}</td>'
        f'<td class="num"><a class="sample-link" href="{link}">{r["index"]}</a></td>'
        f'<td class="num">{r["group_index"]}</td><td class="num reward">{fmt(r["reward"], 3)}</td>'
        f'<td class="status">{e(str(r["status"]))}{turns}</td><td class="num length">{r["response_length"]}</td>'
        f'<td class="num">{fmt(r["mean_logprob"], 3)}</td>'
        f'<td class="num">{r["weight_version_start"]}→{r["weight_version_end"]}</td>'
        f'<td class="snip">{e(r["prompt"] or "")}</td><td class="snip"><a href="{link}">{e(r["response"] or "")}</a></td></tr>'
    )


# ---------------------------------------------------------------------- one sample


def _token_span(
    i: int, tid: int, text: str | None, tv: TokenValues, shade: str, scale: float, experts
) -> str:
    value = tv.series.get(shade, [None] * tv.n)[i] if shade else None
    tip = [f"#{i} id {tid}"] + [
        f"{name} {fmt(vals[i])}" for name, vals in tv.series.items() if vals[i] is not None
    ]
    clipped = tv.clipped is not None and i < len(tv.clipped) and tv.clipped[i]
    if clipped:
        tip.append("clipped")
    if experts is not None and experts[i] is not None:
        tip.append(f"experts L0 {experts[i]}")
    shown = f"[{tid}]" if text is None else (text.replace("\n", "↵\n") or "∅")
    color = shade_color(shade, value, scale)
    cls = "tok" + (" clip" if clipped else "") + (" nov" if shade and value is None else "")
    style = f' style="background:{color}"' if color else ""
    return f'<span class="{cls}"{style} title="{e(" · ".join(tip))}">{e(shown)}</span>'


def _tool_calls(role: str, calls: list[dict[str, Any]] | None) -> str:
    """An assistant turn's calls (tool, arguments); a tool turn's answers (tool, result or error)."""
    if not calls:
        return ""
    cols = ("arguments",) if role == "assistant" else ("result", "error")
    head = "".join(f"<th>{c}</th>" for c in ("tool", *cols))
    rows = "".join(
        f"<tr><td>{e(c.get('name') or '')}</td>"
        + "".join(f'<td class="text call-{k}">{e(c.get(k) or "")}</td>' for k in cols)
        + "</tr>"
        for c in calls
    )
    return f'<table class="tool-calls"><tr>{head}</tr>{rows}</table>'


def _response(sample: dict[str, Any], texts: list[str] | None, tv: TokenValues, shade: str) -> str:
    ids = list(sample.get("response_tokens") or [])
    if not ids:
        return f'<div class="text">{e(sample.get("response") or "")}</div>'
    scale = shade_scale(tv.series.get(shade, [])) if shade else 1.0
    routes = routed_experts_of(sample)
    experts = routes[0] if routes else None
    spans = [
        _token_span(i, t, texts[i] if texts else None, tv, shade, scale, experts) for i, t in enumerate(ids)
    ]
    turns = sample.get("turns")
    if not turns:
        return f'<div class="tokens" id="response">{"".join(spans)}</div>'
    out = []
    for t in turns:
        start, end = int(t.get("start") or 0), int(t.get("end") or 0)
        role = t.get("role") or ""
        finish = f" · {t['finish_reason']}" if t.get("finish_reason") else ""
        out.append(
            f'<div class="turn {e(role)}"><div class="role">{e(role)} · tokens {start}–{end}{e(finish)}</div>'
            f'<div class="tokens">{"".join(spans[start:end])}</div>{_tool_calls(role, t.get("tool_calls"))}</div>'
        )
    return f'<div id="response">{"".join(out)}</div>'


def _facts(sample: dict[str, Any], train: dict[str, Any] | None, n_train: int) -> str:
    rows = [
        ("reward", fmt(sample.get("reward"))), ("raw reward", fmt(sample.get("raw_reward"))),
        ("reward dict", sample.get("reward_json") or ""), ("label", sample.get("label") or ""),
        ("status", sample.get("status")), ("response length", sample.get("response_length")),
        ("weight versions", f"{sample.get('weight_version_start')} → {sample.get('weight_version_end')}"),
        ("removed", "yes" if sample.get("remove_sample") else ""),
    ]  # fmt: skip
    meta = sample.get("metadata")
    if meta and meta not in ("{}", "null"):
        rows.append(("metadata", meta))
    routes = routed_experts_of(sample)
    if routes:
        rows.append(("routed experts (R3)", routes[1] + "; hover a token for its layer-0 experts"))
    if sample.get("teacher_log_probs") is not None:
        kl = sample.get("opd_reverse_kl")
        rows.append(("teacher (OPD)", "scored" + (f"; mean reverse KL {fmt(_mean(kl))}" if kl else "")))
    if train is not None:
        ids = ", ".join(
            f"{k} {train[k]}" for k in ("version", "step", "micro_batch", "rank") if train.get(k) is not None
        )
        rows.append(("trained", ids + (f" (first of {n_train} rows)" if n_train > 1 else "")))
        for k in ("advantage", "ref_kl"):
            if isinstance(train.get(k), int | float):
                rows.append((k, fmt(train[k])))
    else:
        rows.append(("trained", "no train_samples row (the table is absent or does not hold this sample)"))
    body = "".join(f"<tr><td>{e(k)}</td><td>{e(str(v))}</td></tr>" for k, v in rows if v not in ("", None))
    return f'<table class="facts">{body}</table>'


def _mean(values: list[float] | None) -> float | None:
    vals = [v for v in values or [] if v is not None and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def _group(sample: dict[str, Any], group: list[dict[str, Any]], shade: str) -> str:
    run, rid = sample["run"], sample["rollout_id"]
    cards = []
    for g in group:
        me = " me" if g["index"] == sample["index"] else ""
        inner = (
            f'<img src="{e(_image_src(run, rid, g["index"]))}" width="96" height="96">'
            if g["has_image"]
            else f'<div class="snip">{e(g["response"] or "")}</div>'
        )
        cards.append(
            f'<div class="card{me}"><a href="{e(_sample_href(run, rid, g["index"], shade))}">#{g["index"]}</a> '
            f"reward <b>{fmt(g['reward'], 3)}</b> · {e(str(g['status']))} · {g['response_length']} tokens{inner}</div>"
        )
    rewards = [g["reward"] for g in group if g["reward"] is not None]
    mean = f" · mean reward {fmt(sum(rewards) / len(rewards), 3)}" if rewards else ""
    return (
        f"<h3>Group {sample['group_index']}: {len(group)} samples{mean}</h3>"
        f'<div class="group" id="group">{"".join(cards)}</div>'
    )


def sample_page(
    sample: dict[str, Any],
    train: dict[str, Any] | None,
    n_train: int,
    tv: TokenValues,
    shade: str,
    texts: list[str] | None,
    group: list[dict[str, Any]],
    neighbours: tuple,
    root: str,
) -> str:
    run, rid, idx = sample["run"], sample["rollout_id"], sample["index"]
    crumbs = (
        f'<a href="/">runs</a> › <a href="{e(href("/samples", run=run))}">{e(run)}</a> › '
        f'<a href="{e(href("/samples", run=run, rollout_from=rid, rollout_to=rid))}">rollout {rid}</a> › sample {idx}'
    )
    prev, nxt = neighbours
    nav = "".join(
        f' <a href="{e(_sample_href(run, rid, i, shade))}">{label}</a>'
        for i, label in ((prev, "‹ prev"), (nxt, "next ›"))
        if i is not None
    )
    shades = "".join(
        f'<a class="{"on" if s == shade else ""}" data-shade="{s}" href="{e(_sample_href(run, rid, idx, s))}">{e(SHADES[s])}</a>'
        for s in tv.available()
    )
    legend = _legend(shade)
    tokenizer = (
        "" if texts is not None or not sample.get("response_tokens") else " (no tokenizer found: token ids)"
    )
    parts = [
        f"<p>{crumbs}{nav}</p>",
        _facts(sample, train, n_train),
        f'<div class="box"><b>Prompt</b><div class="text" id="prompt">{e(sample.get("prompt") or "")}</div></div>',
        f'<div class="box"><b>Response</b>{e(tokenizer)} <span class="shades">shade by: {shades}</span>{legend}'
        f'<div class="tokinfo" id="tokinfo">hover a token for its id and values</div>'
        f"{_response(sample, texts, tv, shade)}</div>{TOKEN_INFO_JS}",
    ]
    if sample.get("has_image"):
        parts.append(f'<div class="box"><img class="big" src="{e(_image_src(run, rid, idx))}"></div>')
    if sample.get("image_hashes"):  # a vision-language prompt: the images it saw, in order
        imgs = "".join(
            f'<img class="big" title="{e(h)}" alt="image {i}" src="{e(href("/prompt_image", run=run, hash=h))}">'
            for i, h in enumerate(sample["image_hashes"])
        )
        parts.insert(3, f'<div class="box"><b>Images</b> (by content hash)<div>{imgs}</div></div>')
    parts.append(_group(sample, group, shade))
    return layout(f"{run} r{rid} #{idx}", "".join(parts), root)


# the hovered token's values in a line above the response (its `title` holds them)
TOKEN_INFO_JS = """<script>
document.getElementById("response")?.addEventListener("mouseover", (ev) => {
  const tok = ev.target.closest(".tok");
  if (tok) document.getElementById("tokinfo").textContent = tok.title;
});
</script>"""


def _legend(shade: str) -> str:
    text = {
        "advantage": "green: positive advantage, red: negative; the deeper, the larger",
        "gap": "green: the trainer gives the token more log-prob than the engine did, red: less",
        "teacher": "green: the teacher likes the token more than the policy did, red: less",
        "logprob": "orange: the less likely the engine found the token, the deeper",
        "loss_mask": "blue: in the loss, grey: masked out (tool output, padding)",
    }.get(shade, "")
    note = " · wavy underline: clipped"
    return f'<div class="legend" style="font-size:12px;color:#555">{e(text + note)}</div>'


def json_safe(value: Any) -> Any:
    """A value for the JSON API: bytes dropped, non-finite floats and other types as strings."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items() if not isinstance(v, bytes)}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)
