"""The side-by-side page people read, and judge: one self-contained HTML file (no server, nothing fetched, it
opens from file:// or a CI artifact as it is).

Every page shows each prompt, its reference and each column's answer, marks exact matches and answers cut off
at max_new_tokens. A page of two models (evaluate.py --compare) is also a judging page: the answers are shown blind, as
"A" and "B" in an order shuffled per prompt (sample_records.blind_order), and a person picks A better, B better,
tie or both bad, from buttons or the keyboard. Choices are kept in the browser's localStorage as they are made
and exported as JSONL (judge_page.js); `tools/evaluate.py --judgments` reads the exports back, and a page
rebuilt with their summary shows the win rates above the table.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from zero_recipes.checkpointing.atomic import write_text

from .sample_records import blind_order, exact_match, page_id, rows_of

PROMPT_PCT, REF_PCT = 24, 12
CHOICES = (("left", "A better", "1"), ("right", "B better", "2"), ("tie", "Tie", "3"), ("both_bad", "Both bad", "4"))
KEYS = "1 A better · 2 B better · 3 tie · 4 both bad · j / ↓ next · k / ↑ previous"


def write_page(html_path, records: list[dict], title: str, judging: bool = False, summary: dict | None = None) -> None:
    """The page: a header (the title, each column's decoding and exact matches, the judgments' summary when
    given), then one row per prompt with its reference and each column's answer. `judging`: two models to be
    judged blind (a page of training steps is read, not judged)."""
    rows, columns = rows_of(records)
    with_ref = any(row["reference"] is not None for row in rows)
    judging = judging and len(columns) == 2
    e, counts = html.escape, _exact_counts(rows, columns)
    legend = f"<table class=legend>{_legend(columns, counts, with_ref)}</table>"
    what = f"{len(rows)} prompts, {len(columns)} column{'s' * (len(columns) != 1)}"
    what += "; ✓ marks an answer equal to the reference (surrounding whitespace ignored)" if with_ref else ""
    if judging:
        page = page_id(records)
        orders = [blind_order(page, i, list(columns)) for i in range(1, len(rows) + 1)]
        table = _judging_table(rows, orders, with_ref)
        header = _judging_header(legend, summary, len(rows))
        data = {
            "page": page,
            "rows": [
                {"row": i, "left": o[0], "right": o[1], "prompt": r["prompt"]}
                for i, (r, o) in enumerate(zip(rows, orders), 1)
            ],
        }
        script = (
            f"<script type=application/json id=judging-data>{_script_json(data)}</script>"
            f"<script>{Path(__file__).with_name('judge_page.js').read_text(encoding='utf-8')}</script>"
        )
    else:
        table, header, script = _reading_table(rows, columns, counts, with_ref), legend, ""
    write_text(
        Path(html_path),
        f"<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8><title>{e(title)}</title>"
        f"<style>{CSS}</style></head><body><header><h1>{e(title)}</h1><p class=meta>{what}</p>{header}</header>"
        f"{table}{script}</body></html>\n",
    )


def _script_json(data) -> str:
    # inside <script>, "</script>" in a prompt would end the element: every "<" is written as its JSON escape
    return json.dumps(data, ensure_ascii=False).replace("<", "\\u003c")


def _exact_counts(rows, columns) -> dict[str, tuple[int, int]]:
    counts = {}
    for label in columns:
        judged = [row for row in rows if row["reference"] is not None and label in row["outputs"]]
        counts[label] = (sum(exact_match(row["outputs"][label], row["reference"]) for row in judged), len(judged))
    return counts


def _legend(columns, counts, with_ref: bool) -> str:
    e = html.escape
    return "".join(
        f"<tr><th>{e(label)}</th><td>{e(how)}</td>"
        + (f"<td>{counts[label][0]} / {counts[label][1]} exact</td>" if with_ref else "")
        + "</tr>"
        for label, how in columns.items()
    )


def _colgroup(n_answers: int, with_ref: bool, judge_col: bool) -> str:
    share = (100 - PROMPT_PCT - (REF_PCT if with_ref else 0) - 12 * judge_col) / max(n_answers, 1)
    cols = f"<col style='width:3em'><col style='width:{PROMPT_PCT}%'>"
    cols += (f"<col style='width:{REF_PCT}%'>" if with_ref else "") + f"<col style='width:{share:.2f}%'>" * n_answers
    return f"<colgroup>{cols}{'<col style=width:12%>' if judge_col else ''}</colgroup>"


def _reading_table(rows, columns, counts, with_ref: bool) -> str:
    e = html.escape
    head = "<th class=n>#</th><th>Prompt</th>" + ("<th>Reference</th>" if with_ref else "")
    for label in columns:
        hit, of = counts[label]
        head += (
            f"<th>{e(label)}" + (f"<span class=count><b>✓</b> {hit} / {of} exact</span>" if with_ref else "") + "</th>"
        )
    body = ""
    for i, row in enumerate(rows, 1):
        cells = _prompt_cells(i, row, with_ref)
        cells += "".join(_answer_cell(row, label) for label in columns)
        body += f"<tr>{cells}</tr>"
    # past a few columns the table scrolls sideways rather than squeezing each answer into a sliver
    wide = 360 + 160 * with_ref + 220 * len(columns)
    return (
        f"<table class=samples style='min-width:{wide}px'>{_colgroup(len(columns), with_ref, False)}"
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    )


def _judging_table(rows, orders, with_ref: bool) -> str:
    head = "<th class=n>#</th><th>Prompt</th>" + ("<th>Reference</th>" if with_ref else "")
    head += "<th>Answer A</th><th>Answer B</th><th>Your judgment</th>"
    buttons = "".join(
        f"<button type=button data-choice={c}>{name} <kbd>{key}</kbd></button>" for c, name, key in CHOICES
    )
    body = ""
    for i, (row, (left, right)) in enumerate(zip(rows, orders), 1):
        cells = _prompt_cells(i, row, with_ref) + _answer_cell(row, left, "A") + _answer_cell(row, right, "B")
        body += f"<tr data-row={i}>{cells}<td class=judge>{buttons}</td></tr>"
    return (
        f"<table class='samples judging' style='min-width:{620 + 160 * with_ref}px'>{_colgroup(2, with_ref, True)}"
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    )


def _judging_header(legend: str, summary: dict | None, n_rows: int) -> str:
    toolbar = (
        "<div class=toolbar><label>Judge <input id=judge autocomplete=off placeholder='your name'></label>"
        f"<span id=progress>0 / {n_rows} judged</span><button type=button id=reveal>Reveal names</button>"
        f"<button type=button id=export>Export judgments</button><span class=keys>{KEYS}</span>"
        "<span id=status role=status></span></div>"
    )
    blind = (
        "<p class=blind>Model names are hidden and A / B are shuffled per prompt, so neither a name nor a side "
        "sways the choice. Revealing them is recorded with each choice made after it.</p>"
    )
    return (_summary_html(summary) if summary else "") + blind + f"<div class=names>{legend}</div>" + toolbar


def _prompt_cells(i: int, row: dict, with_ref: bool) -> str:
    ref = row["reference"]
    cells = f"<td class=n>{i}</td><td>{_prompt_html(row['prompt'])}</td>"
    if with_ref:
        cells += f"<td class=ref>{_text(ref) if ref is not None else '<span class=none>none</span>'}</td>"
    return cells


def _answer_cell(row: dict, label: str, side: str | None = None) -> str:
    """One answer. On a judging page (`side` given) it carries its model's name, shown once revealed."""
    out, ref = row["outputs"].get(label), row["reference"]
    if out is None:
        return "<td class=out><span class=none>not asked</span></td>"
    who = f"<span class=who>{side} = {html.escape(label)}</span>" if side else ""
    cut = "<span class=cut>✂ cut off at max_new_tokens</span>" if row["ended"].get(label) is False else ""
    if exact_match(out, ref):
        return f"<td class='out match'>{who}{_text(out)}<span class=mark>✓ exact match</span>{cut}</td>"
    text = _text(out) if out.strip() else "<span class=none>(empty)</span>"
    cls = "'out cutoff'" if cut else "out"
    return f"<td class={cls}>{who}{text}{cut}</td>"


def _summary_html(s: dict) -> str:
    """The judgments' summary (judgments.summarise) above the table of a rebuilt page."""
    e = html.escape
    pct = lambda x: "–" if x is None else f"{100 * x:.1f} %"  # noqa: E731
    rates = "".join(
        f"<tr><th>{e(m)}</th><td>{pct(w['rate'])}</td><td>{pct(w['low'])} – {pct(w['high'])}</td>"
        f"<td>{w['wins']}</td><td>{w['losses']}</td><td>{w['ties']}</td><td>{w['both_bad']}</td></tr>"
        for m, w in s["win_rates"].items()
    )
    kappa = lambda k: "undefined" if k is None else f"{k:.2f}"  # noqa: E731
    agree = "".join(
        f"<li>{e(a['judges'][0])} and {e(a['judges'][1])}: {a['percent']:.0f} % agreement on {a['shared']} prompts, "
        f"Cohen's κ {kappa(a['kappa'])}</li>"
        for a in s["agreement"]
    )
    pos = s["position"]
    side = (
        f"The left column won {pos['left_won']} of {pos['decisive']} decisive judgments ({pct(pos['rate'])}, "
        f"p = {pos['p_value']:.2g} against an even split)."
        if pos["decisive"]
        else "No decisive judgments, so no position bias to measure."
    )
    judges = ", ".join(e(j) for j in s["judges"])
    return (
        f"<section class=summary><h2>Judgments</h2><p class=meta>{s['prompts_judged']} prompts judged, "
        f"{s['judgments']} judgments by {len(s['judges'])} judge{'s' * (len(s['judges']) != 1)} ({judges}). "
        "Win rate: a tie or both-bad counts half to each; 95 % interval by bootstrap over prompts.</p>"
        "<table class=rates><tr><th>Model</th><th>Win rate</th><th>95 % interval</th><th>Wins</th><th>Losses</th>"
        f"<th>Ties</th><th>Both bad</th></tr>{rates}</table>"
        + (f"<ul>{agree}</ul>" if agree else "")
        + f"<p>{side}</p></section>"
    )


def _text(s: str) -> str:
    return f"<div class=text>{html.escape(s)}</div>"


def _prompt_html(prompt) -> str:
    if isinstance(prompt, str):
        return _text(prompt)
    if len(prompt) == 1 and prompt[0].get("role") == "user":  # a one-message chat reads as a plain question
        return _text(str(prompt[0].get("content", "")))
    return "".join(
        f"<div class=msg><span class=role>{html.escape(str(m.get('role', '')))}</span>"
        f"{_text(str(m.get('content', '')))}</div>"
        for m in prompt
    )


CSS = """
body{margin:28px 32px;font:14px/1.5 "DejaVu Sans","Segoe UI",system-ui,sans-serif;color:#1f2328;background:#fff}
h1{font-size:21px;margin:0 0 2px}.meta{color:#59636e;margin:0 0 12px}table{border-collapse:collapse}
.legend{margin:0 0 20px;font-size:13px}
.legend th,.legend td{padding:2px 18px 2px 0;text-align:left;vertical-align:top}.legend td{color:#59636e}
.samples{width:100%;table-layout:fixed}
.samples th,.samples td{padding:9px 12px;text-align:left;vertical-align:top;border-bottom:1px solid #d8dee4}
.samples th{position:sticky;top:0;background:#f6f8fa;border-bottom:2px solid #d0d7de;font-weight:600}
.samples tbody tr:nth-child(even) td{background:#fafbfc}
.n{color:#8c959f;text-align:right!important;font-variant-numeric:tabular-nums}
.count{display:block;font-weight:400;font-size:12px;color:#59636e}.count b{color:#1a7f37}
.text{white-space:pre-wrap;overflow-wrap:anywhere}
.out .text,.ref .text{font:13px/1.5 "DejaVu Sans Mono",ui-monospace,monospace}.ref .text{color:#0a3069}
.samples td.match{box-shadow:inset 4px 0 0 #1a7f37;background:#eefbf1!important}
.mark{display:inline-block;margin-top:4px;font-size:12px;font-weight:600;color:#1a7f37}.msg+.msg{margin-top:6px}
.role{display:block;font-size:11px;text-transform:uppercase;letter-spacing:.04em;color:#6e7781}
.none{color:#8c959f;font-style:italic}
.cut{display:block;margin-top:4px;font-size:12px;font-weight:600;color:#9a6700}
.samples td.cutoff{box-shadow:inset 4px 0 0 #d4a72c}
.blind{color:#59636e;margin:0 0 8px;font-size:13px}.revealed .blind{display:none}
.names{display:none}.revealed .names{display:block}.who{display:none}
.revealed .who{display:block;font-size:11px;font-weight:600;color:#8250df;margin-bottom:2px}
.toolbar{position:sticky;top:0;z-index:2;display:flex;flex-wrap:wrap;gap:8px 14px;align-items:center;
padding:8px 12px;margin:0 0 10px;background:#f6f8fa;border:1px solid #d0d7de;border-radius:6px;font-size:13px}
.toolbar input{font:inherit;padding:2px 6px;width:11em}.keys{color:#59636e}#status{color:#1a7f37;font-weight:600}
#status.warn{color:#cf222e}
button{font:inherit;font-size:12px;padding:3px 8px;border:1px solid #d0d7de;border-radius:6px;background:#fff;
cursor:pointer}
.judge button{display:block;width:100%;margin:0 0 4px;text-align:left}.judge kbd{float:right;color:#8c959f}
.judge button.chosen{background:#0969da;border-color:#0969da;color:#fff}.judge button.chosen kbd{color:#fff}
.samples.judging thead th{top:46px}
.samples tr.current td{background:#fff8c5!important}.samples tr.current td.n{box-shadow:inset 4px 0 0 #bf8700}
.summary{margin:0 0 16px}.summary h2{font-size:16px;margin:0 0 4px}
.rates th,.rates td{padding:3px 14px 3px 0;text-align:left}.summary ul{margin:6px 0;padding-left:20px}
"""
