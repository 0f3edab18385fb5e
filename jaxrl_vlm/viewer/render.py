"""The viewer's one HTML renderer, used by the server (`jaxrl-vlm view RUN_DIR`) and by `--export FILE.html`.

`render_page` writes a whole page: the run's sources (training steps, eval rounds) as navigation, then the chosen
sources' episodes turn by turn: the prompt's pictures and text; per turn the tokens coloured by loss mask (green:
trained model tokens, grey: observation tokens; a token's log-prob on hover), the observation's pictures exactly as
the engine received them (or their thumbnails, with the size sent), finish reason, latencies, retries and weight
version; per episode reward, status, termination cause, weight versions and errors. Filters (FAILED, TRUNCATED,
zero reward) run in the page's own script, so an exported page filters too. `render_compare` puts two eval rounds'
answers to the same prompts side by side.

How pictures are addressed is the caller's: `image_src(relative_path)` gives a URL (server) or a data URL (export).

No jax.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence

from jaxrl_vlm.viewer.records import Episode, ImageRef, RunIndex, Source, Turn

ImageSrc = Callable[[str], str]

_CSS = """
body{font-family:system-ui,sans-serif;margin:0;background:#f6f6f4;color:#222}
header{background:#263238;color:#fff;padding:8px 16px}header a{color:#cfe}
nav{display:flex;flex-wrap:wrap;gap:6px;padding:8px 16px;background:#eceff1}
nav a{padding:2px 6px;border:1px solid #b0bec5;border-radius:4px;text-decoration:none;color:#234;font-size:13px}
nav a.current{background:#263238;color:#fff}
.filters{padding:6px 16px;font-size:14px}.filters label{margin-right:14px}
section.source{padding:0 16px 16px}h2{font-size:18px;margin:14px 0 4px}
.episode{background:#fff;border:1px solid #ddd;border-radius:6px;margin:10px 0;padding:8px 12px}
.episode.failed{border-left:6px solid #c62828}.episode.truncated{border-left:6px solid #ef6c00}
.episode h3{font-size:15px;margin:2px 0 6px}.meta{font-size:12px;color:#555}
.turn{border-top:1px dashed #ccc;padding:6px 0}.turn h4{font-size:13px;margin:2px 0}
.tokens{font-family:monospace;font-size:12px;white-space:pre-wrap;line-height:1.7}
.tok{border-radius:2px}.m1{background:#c8e6c9}.m0{background:#eceff1;color:#555}
.imgpad{background:#bbdefb;color:#0d47a1}
figure{display:inline-block;margin:4px 8px 4px 0;font-size:11px;color:#555}
figure img{border:1px solid #999;image-rendering:pixelated;max-width:256px;display:block}
pre{white-space:pre-wrap;font-size:12px;background:#fafafa;padding:4px;margin:4px 0}
table.compare{border-collapse:collapse;width:100%}table.compare td,table.compare th{border:1px solid #ccc;
padding:4px;vertical-align:top;font-size:12px}.err{color:#c62828;font-size:12px}
"""

_SCRIPT = """
function applyFilters(){
  const on=[...document.querySelectorAll('.filters input:checked')].map(e=>e.dataset.filter);
  let shown=0;
  document.querySelectorAll('.episode').forEach(ep=>{
    const ok=on.length===0||on.some(f=>ep.dataset[f]==='1');
    ep.style.display=ok?'':'none'; if(ok) shown++;
  });
  const c=document.getElementById('shown'); if(c) c.textContent=shown;
}
document.querySelectorAll('.filters input').forEach(e=>e.addEventListener('change',applyFilters));
window.addEventListener('load',()=>{  // for headless checks: how many pictures decoded
  const imgs=[...document.querySelectorAll('img')];
  document.body.dataset.imagesLoaded=imgs.filter(i=>i.complete&&i.naturalWidth>0).length;
  document.body.dataset.imagesBroken=imgs.filter(i=>!(i.complete&&i.naturalWidth>0)).length;
});
"""


def _e(value: object) -> str:
    return html.escape("" if value is None else str(value))


def _figure(ref: ImageRef, image_src: ImageSrc, caption: str) -> str:
    shrunk = (ref.width, ref.height) != (ref.sent_width, ref.sent_height)
    size = f"{ref.sent_width}x{ref.sent_height} sent" + (f", shown {ref.width}x{ref.height}" if shrunk else "")
    return (f'<figure><img class="obs" src="{_e(image_src(ref.file))}" width="{ref.width}" height="{ref.height}" '
            f'alt="{_e(caption)}"><figcaption>{_e(caption)} ({size})</figcaption></figure>')


def _tokens(turn: Turn) -> str:
    if not turn.tokens:
        return (f'<div class="tokens"><span class="tok m1">{_e(turn.model_text)}</span>'
                f'<span class="tok m0">{_e(turn.observation_text)}</span></div>')
    parts = []
    teacher = turn.teacher_logprobs or (None,) * len(turn.tokens)
    for (text, mask, logprob, count), teacher_lp in zip(turn.tokens, teacher):
        title = f"loss mask {mask}" + ("" if logprob is None else f", log p = {logprob:.4f}")
        if teacher_lp is not None:  # on-policy distillation: the teacher's beside the student's
            title += f", teacher log p = {teacher_lp:.4f}"
        if text == "<|image_pad|>":
            parts.append(f'<span class="tok imgpad m{mask}" title="{title}">[image x{count}]</span>')
        else:
            parts.append(f'<span class="tok m{mask}" title="{_e(title)}">{_e(text)}</span>')
    return f'<div class="tokens">{"".join(parts)}</div>'


def _turn(turn: Turn, image_src: ImageSrc, number: int) -> str:
    meta = [f"model tokens {turn.model_tokens}", f"observation tokens {turn.observation_tokens}"]
    for label, value in (("finish", turn.finish_reason), ("weight version", turn.weight_version),
                         ("engine", None if turn.engine_latency_s is None else f"{turn.engine_latency_s:.3f} s"),
                         ("env", None if turn.env_latency_s is None else f"{turn.env_latency_s:.3f} s"),
                         ("env retries", turn.env_retries), ("truncation", turn.truncation_cause)):
        if value is not None:
            meta.append(f"{label} {value}")
    figures = "".join(_figure(ref, image_src, f"turn {number} observation picture {k}") for k, ref in enumerate(turn.images))
    error = f'<div class="err">{_e(turn.error)}</div>' if turn.error else ""
    return (f'<div class="turn" data-turn="{number}"><h4>Turn {number}</h4><div class="meta">{_e(", ".join(meta))}</div>'
            f"{_tokens(turn)}{figures}{error}</div>")


def _episode(ep: Episode, image_src: ImageSrc) -> str:
    flags = (f'data-failed="{int(ep.failed)}" data-truncated="{int(ep.truncated)}" '
             f'data-zero="{int(ep.zero_reward)}"')
    reward = "none" if ep.reward is None else f"{ep.reward:.3f}"
    meta = (f"reward {reward} | status {ep.status.upper()} | termination {ep.termination or '-'} | weight versions "
            f"{', '.join(ep.weight_versions) or '-'} | env retries {ep.retries} | label {str(ep.label)[:80]}")
    prompt_figs = "".join(_figure(ref, image_src, f"prompt picture {k}") for k, ref in enumerate(ep.prompt_images))
    errors = "".join(f'<div class="err">{_e(e)}</div>' for e in ep.errors)
    turns = "".join(_turn(t, image_src, k + 1) for k, t in enumerate(ep.turns))
    return (f'<article class="episode {ep.status}" {flags}><h3>group {ep.group_index}, sample {ep.index}</h3>'
            f'<div class="meta">{_e(meta)}</div>{errors}<div class="prompt">{prompt_figs}<pre>{_e(ep.prompt_text)}</pre>'
            f"</div>{turns}</article>")


def render_source(source: Source, episodes: Sequence[Episode], image_src: ImageSrc) -> str:
    rewards = [e.reward for e in episodes if e.reward is not None]
    mean = f"{sum(rewards) / len(rewards):.3f}" if rewards else "-"
    counts = {s: sum(e.status == s for e in episodes) for s in sorted({e.status for e in episodes})}
    summary = f"{len(episodes)} episodes, mean reward {mean}, " + ", ".join(f"{k} {v}" for k, v in counts.items())
    body = "".join(_episode(e, image_src) for e in episodes)
    return (f'<section class="source" id="{_e(source.key)}" data-source="{_e(source.key)}"><h2>{_e(source.title)}</h2>'
            f'<div class="meta">{_e(source.key)}: {_e(summary)}</div>{body}</section>')


def render_compare(a: Source, a_eps: Sequence[Episode], b: Source, b_eps: Sequence[Episode]) -> str:
    """Two eval rounds' answers to the same prompts (matched by group and sample index), side by side."""
    by_key = {(e.group_index, e.index): e for e in b_eps}
    rows = []
    for ep in a_eps:
        other = by_key.get((ep.group_index, ep.index))
        cell = lambda e: "<td>-</td>" if e is None else (  # noqa: E731
            f'<td><div class="meta">reward {e.reward}, {e.status}</div><pre>{_e(e.final_answer)}</pre></td>')
        rows.append(f"<tr><td><pre>{_e(ep.prompt_text[-300:])}</pre></td>{cell(ep)}{cell(other)}</tr>")
    return (f'<section class="source compare"><h2>Side by side: {_e(a.title)} | {_e(b.title)}</h2>'
            f'<table class="compare"><tr><th>prompt</th><th>{_e(a.title)}</th><th>{_e(b.title)}</th></tr>'
            f'{"".join(rows)}</table></section>')


def render_page(index: RunIndex, sections: Sequence[str], *, current: Sequence[str] = (),
                nav_href: Callable[[Source], str], note: str = "") -> str:
    """A whole page: navigation over `index`'s sources (`current` highlighted), the filters, the `sections`."""
    links = []
    for source in index.sources:
        cls = ' class="current"' if source.key in current else ""
        links.append(f'<a{cls} href="{_e(nav_href(source))}">{_e(source.title)}</a>')
    filters = ('<div class="filters">Show only: <label><input type="checkbox" data-filter="failed"> FAILED</label>'
               '<label><input type="checkbox" data-filter="truncated"> TRUNCATED</label>'
               '<label><input type="checkbox" data-filter="zero"> zero reward (&le; 0)</label>'
               ' <span class="meta"><span id="shown"></span> shown</span></div>')
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>jaxrl-vlm trajectories: {_e(index.root.name)}'
            f'</title><style>{_CSS}</style></head><body><header><b>jaxrl-vlm trajectories</b> {_e(index.root)}'
            f' {_e(note)}</header><nav>{"".join(links)}</nav>{filters}{"".join(sections)}'
            f"<script>{_SCRIPT}applyFilters();</script></body></html>")
