"""The viewer's one HTML renderer, used by the server (`jaxrl-vlm view RUN_DIR`) and by `--export FILE.html`.

`render_page` writes a whole page: the run's sources (training steps, eval rounds) as navigation, then the chosen
sources' episodes turn by turn: the prompt's text with its pictures in place of their image pads; per turn the
tokens coloured by loss mask (green: trained model tokens, grey: observation tokens; a token's log-prob on hover),
the observation's pictures in place of their image pads, exactly as the engine received them (or their thumbnails,
with the size sent), finish reason, latencies, retries and weight version; per episode reward, status, termination
cause, weight versions and errors. `render_compare` puts two eval rounds' episodes on the same prompts side by side:
the prompt with its pictures, and per side each turn's action text and observation pictures.

A clip is shown where its pads stand, as a player (`figure.clip`): its frames (`img.frame`, in order, all but the
current one hidden), play/pause, previous/next frame buttons and a frame slider, the frame number, and the clip's
frame count and fps; playing steps through the frames at the clip's fps, in a loop. In the token view the player
follows the clip's first `<|video_pad|>` row (the dump's `row`); in text, the clip's compacted
`<|vision_start|><|video_pad|><|vision_end|>`.

Every long list pages in the page's own script (no server needed, so an exported page pages too): the navigation's
sources, the sections of an exported page, a section's episodes, an episode's turns and the comparison's rows, each
with first/prev/next/last buttons and a page indicator. The first page of each list is already the one shown
before the script runs. Filters (FAILED, TRUNCATED, zero reward) also run in the page's script; a list pages over
the episodes they leave. A link to `#ID` (a source's key, or `KEY:gGROUP-iINDEX` for one episode) opens the pages
that hold it.

How pictures (and frames) are addressed is the caller's: `image_src(relative_path)` gives a URL (server) or a data
URL (export).

No jax.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Sequence

from jaxrl_vlm.viewer.records import ClipRef, Episode, ImageRef, RunIndex, Source, Turn

ImageSrc = Callable[[str], str]

#: Items per page of each paged list.
ROWS_PER_PAGE = 50  # side-by-side comparison rows
EPISODES_PER_PAGE = 50  # a source's episodes
TURNS_PER_PAGE = 20  # an episode's turns
SOURCES_PER_PAGE = 10  # the sections (sources, comparisons) of an exported page
NAV_PER_PAGE = 50  # the navigation's links

IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
#: One picture (group `image`) or clip in decoded text: the dump compacts its pads to one `<|image_pad|>` or
#: `<|video_pad|>` (a run of them is one too), with the vision markers around it when the template writes them.
_MEDIA = re.compile(r"(?:<\|vision_start\|>)?(?:(?P<image>(?:<\|image_pad\|>)+)|(?:<\|video_pad\|>)+)"
                    r"(?:<\|vision_end\|>)?")
#: Chat-template markers dropped from the comparison's readable text.
_SPECIAL = re.compile(r"<\|im_start\|>(?:system|user|assistant|tool)?\n?|<\|im_end\|>\n?|<\|[a-z_]+\|>")

_CSS = """
body{font-family:system-ui,sans-serif;margin:0;background:#f6f6f4;color:#222}
[hidden]{display:none!important}
header{background:#263238;color:#fff;padding:8px 16px}header a{color:#cfe}
nav{padding:6px 16px;background:#eceff1}nav .items{display:flex;flex-wrap:wrap;gap:6px}
nav a{padding:2px 6px;border:1px solid #b0bec5;border-radius:4px;text-decoration:none;color:#234;font-size:13px}
nav a.current{background:#263238;color:#fff}
.filters{padding:6px 16px;font-size:14px}.filters label{margin-right:14px}
section.source{padding:0 16px 16px}h2{font-size:18px;margin:14px 0 4px}
.pager{font-size:12px;color:#444;margin:4px 0;display:flex;gap:4px;align-items:center}
.pager button{font-size:12px;padding:1px 6px}.pager .pageinfo{margin:0 6px}
.episode{background:#fff;border:1px solid #ddd;border-radius:6px;margin:10px 0;padding:8px 12px}
.episode.failed{border-left:6px solid #c62828}.episode.truncated{border-left:6px solid #ef6c00}
.episode h3{font-size:15px;margin:2px 0 6px}.meta{font-size:12px;color:#555}
.turn{border-top:1px dashed #ccc;padding:6px 0}.turn h4{font-size:13px;margin:2px 0}
.tokens{font-family:monospace;font-size:12px;white-space:pre-wrap;line-height:1.7}
.tok{border-radius:2px}.m1{background:#c8e6c9}.m0{background:#eceff1;color:#555}
.imgpad{background:#bbdefb;color:#0d47a1}.vidpad{background:#e1bee7;color:#4a148c}
figure.clip .frames{display:inline-block;border:1px solid #7b1fa2}figure.clip .frames img{border:0}
.clipctl{display:flex;gap:3px;align-items:center;margin:2px 0}.clipctl button{font-size:11px;padding:0 5px}
.clipctl input{width:110px}.clipinfo{font-family:monospace;white-space:nowrap}
figure.clip.small{margin:2px 4px 2px 0}figure.clip.small img{max-width:128px;max-height:128px;width:auto;height:auto}
figure{display:inline-block;margin:4px 8px 4px 0;font-size:11px;color:#555;vertical-align:top;white-space:normal}
figure img{border:1px solid #999;image-rendering:pixelated;max-width:256px;display:block}
figcaption{width:0;min-width:100%}
img.thumb{border:1px solid #999;image-rendering:pixelated;max-width:128px;max-height:128px;width:auto;height:auto;
vertical-align:middle;margin:2px 4px 2px 0}
pre{white-space:pre-wrap;font-size:12px;background:#fafafa;padding:4px;margin:4px 0}
table.compare{border-collapse:collapse;width:100%}table.compare td,table.compare th{border:1px solid #ccc;
padding:4px;vertical-align:top;font-size:12px}table.compare td:first-child{width:22%}.err{color:#c62828;font-size:12px}
.cturn{margin:2px 0 4px}.cturn .act{font-family:monospace;background:#c8e6c9;border-radius:2px;white-space:pre-wrap}
.cturn .obs{color:#555;white-space:pre-wrap}.ctext{white-space:pre-wrap}
"""

_SCRIPT = """
const PAGERS=[];
function pagerItems(box){
  const holder=[...box.querySelectorAll('.items')].find(h=>h.closest('.paged')===box);
  return holder?[...holder.children].filter(c=>c.classList.contains('item')):[];
}
function showPage(st){
  const kept=st.items.filter(i=>i.dataset.out!=='1');
  const n=Math.max(1,Math.ceil(kept.length/st.size));
  st.page=Math.min(Math.max(st.page,0),n-1);
  const lo=st.page*st.size,hi=Math.min(lo+st.size,kept.length);
  const on=new Set(kept.slice(lo,hi));
  st.items.forEach(i=>{i.hidden=!on.has(i);});
  st.box.querySelectorAll('.pager').forEach(p=>{
    if(p.closest('.paged')!==st.box) return;
    p.hidden=kept.length<=st.size;
    p.querySelector('.pageinfo').textContent=
      `page ${st.page+1} of ${n} (${st.what} ${kept.length?lo+1:0}\\u2013${hi} of ${kept.length})`;
    p.querySelectorAll('button').forEach(b=>{
      const back=b.dataset.act==='first'||b.dataset.act==='prev';
      b.disabled=back?st.page===0:st.page>=n-1;
    });
  });
  st.box.dataset.page=st.page+1; st.box.dataset.pages=n;
}
document.querySelectorAll('.paged').forEach(box=>{
  const st={box,size:+box.dataset.pageSize,what:box.dataset.what,items:pagerItems(box),page:0};
  box._pager=st; PAGERS.push(st);
  box.querySelectorAll('.pager button').forEach(b=>{
    if(b.closest('.paged')!==box) return;
    b.addEventListener('click',()=>{
      const a=b.dataset.act;
      st.page=a==='first'?0:a==='prev'?st.page-1:a==='next'?st.page+1:1e9;
      showPage(st);
      const top=box.getBoundingClientRect().top; if(top<0) box.scrollIntoView();
    });
  });
});
function reveal(el){  // open, outermost first, the page of every list that holds el
  const chain=[];
  for(let n=el;n;n=n.parentElement){
    if(!(n.classList&&n.classList.contains('item'))) continue;
    const box=n.closest('.paged'); if(box&&box._pager) chain.push([box._pager,n]);
  }
  chain.reverse().forEach(([st,item])=>{
    const kept=st.items.filter(i=>i.dataset.out!=='1'); const k=kept.indexOf(item);
    if(k>=0){st.page=Math.floor(k/st.size); showPage(st);}
  });
}
function openHash(){
  const id=decodeURIComponent(location.hash.slice(1)); if(!id) return;
  const el=document.getElementById(id); if(!el) return;
  reveal(el); el.scrollIntoView();
}
window.addEventListener('hashchange',openHash);
function applyFilters(){
  const on=[...document.querySelectorAll('.filters input:checked')].map(e=>e.dataset.filter);
  let shown=0;
  document.querySelectorAll('.episode').forEach(ep=>{
    const ok=on.length===0||on.some(f=>ep.dataset[f]==='1');
    ep.dataset.out=ok?'0':'1'; if(ok) shown++;
  });
  PAGERS.forEach(st=>{st.page=0; showPage(st);});
  const c=document.getElementById('shown'); if(c) c.textContent=shown;
}
document.querySelectorAll('.filters input').forEach(e=>e.addEventListener('change',applyFilters));
function clipShow(fig,k){  // a clip player shows frame k (wrapping around)
  const n=fig._frames.length; k=((k%n)+n)%n; fig._k=k;
  fig._frames.forEach((f,j)=>{f.hidden=j!==k;});
  fig.querySelector('.clipseek').value=k;
  fig.querySelector('.clipinfo').textContent=`frame ${k+1} / ${n}`;
  fig.dataset.frame=k;
}
function clipPlay(fig,on){  // play at the clip's fps, in a loop, or pause
  if(fig._timer){clearInterval(fig._timer); fig._timer=null;}
  const fps=+fig.dataset.fps;
  if(on&&fig._frames.length>1&&fps>0) fig._timer=setInterval(()=>clipShow(fig,fig._k+1),1000/fps);
  fig.dataset.playing=fig._timer?'1':'0';
  fig.querySelector('[data-clip=play]').textContent=fig._timer?'pause':'play';
}
document.querySelectorAll('figure.clip').forEach(fig=>{
  fig._frames=[...fig.querySelectorAll('img.frame')]; fig._k=0;
  fig.querySelectorAll('[data-clip]').forEach(b=>b.addEventListener('click',()=>{
    const a=b.dataset.clip;
    if(a==='play'){clipPlay(fig,!fig._timer); return;}
    clipPlay(fig,false); clipShow(fig,fig._k+(a==='next'?1:-1));
  }));
  fig.querySelector('.clipseek').addEventListener('input',e=>{clipPlay(fig,false); clipShow(fig,+e.target.value);});
});
window.addEventListener('load',()=>{  // for headless checks: how many pictures decoded, how many in the first screen
  const imgs=[...document.querySelectorAll('img')];
  const ok=i=>i.complete&&i.naturalWidth>0;
  document.body.dataset.imagesLoaded=imgs.filter(ok).length;
  document.body.dataset.imagesBroken=imgs.filter(i=>!ok(i)).length;
  document.body.dataset.imagesFirstScreen=imgs.filter(i=>{
    const r=i.getBoundingClientRect(); return ok(i)&&r.width>0&&r.top<window.innerHeight&&r.bottom>0;}).length;
});
"""


def _e(value: object) -> str:
    return html.escape("" if value is None else str(value))


def _pager() -> str:
    return ('<div class="pager"><button type="button" data-act="first">&laquo; first</button>'
            '<button type="button" data-act="prev">&lsaquo; prev</button><span class="pageinfo"></span>'
            '<button type="button" data-act="next">next &rsaquo;</button>'
            '<button type="button" data-act="last">last &raquo;</button></div>')


def paged(items: Sequence[str], size: int, what: str, *, tag: str = "div", holder: str = "div",
          around: tuple[str, str] = ("", ""), bottom: bool = True) -> str:
    """A list that pages: `items` (each one element, given class `item`) in a `holder` element of class `items`
    (itself inside `around`'s opening and closing HTML: a table's), inside `tag` (class `paged`), with the pager's
    controls above (and below when `bottom`). Items past the first page start hidden; the page's script does the
    rest."""
    out = []
    for k, item in enumerate(items):
        m = re.match(r"<(\w+)(\s[^>]*)?>", item)
        name, attrs = m.group(1), m.group(2) or ""
        cls = re.search(r'\sclass="([^"]*)"', attrs)
        attrs = (attrs[: cls.start()] + f' class="item {cls.group(1)}"' + attrs[cls.end():]) if cls else \
            f' class="item"{attrs}'
        out.append(f"<{name}{attrs}{' hidden' if k >= size else ''}>{item[m.end():]}")
    n = len(items)
    info = f"page 1 of {max(1, -(-n // size))} ({what} {1 if n else 0}\u2013{min(n, size)} of {n})"
    pager = _pager().replace('<span class="pageinfo"></span>', f'<span class="pageinfo">{_e(info)}</span>')
    if n <= size:
        pager = pager.replace('<div class="pager">', '<div class="pager" hidden>')
    return (f'<{tag} class="paged" data-page-size="{size}" data-what="{_e(what)}">{pager}'
            f'{around[0]}<{holder} class="items">{"".join(out)}</{holder}>{around[1]}{pager if bottom else ""}</{tag}>')


def _figure(ref: ImageRef, image_src: ImageSrc, caption: str) -> str:
    shrunk = (ref.width, ref.height) != (ref.sent_width, ref.sent_height)
    size = f"{ref.sent_width}x{ref.sent_height} sent" + (f", shown {ref.width}x{ref.height}" if shrunk else "")
    return (f'<figure title="{_e(caption)} ({size})"><img class="obs" src="{_e(image_src(ref.file))}" '
            f'width="{ref.width}" height="{ref.height}" alt="{_e(caption)}"><figcaption>{size}</figcaption></figure>')


def _thumb(ref: ImageRef, image_src: ImageSrc, caption: str) -> str:
    return (f'<img class="thumb" src="{_e(image_src(ref.file))}" width="{ref.width}" height="{ref.height}" '
            f'alt="{_e(caption)}" title="{_e(caption)} ({ref.sent_width}x{ref.sent_height} sent)">')


def _player(ref: ClipRef, image_src: ImageSrc, caption: str, *, small: bool = False) -> str:
    """A clip as a player: its frames in order (the first shown), play/pause, step buttons, a frame slider, and its
    frame count and fps (the page's script plays it at that fps)."""
    n = len(ref.frames)
    shrunk = (ref.width, ref.height) != (ref.sent_width, ref.sent_height)
    about = (f"{n} frame{'' if n == 1 else 's'} at {ref.fps:g} fps, {ref.sent_width}x{ref.sent_height} sent"
             + (f", shown {ref.width}x{ref.height}" if shrunk else ""))
    frames = "".join(f'<img class="frame" src="{_e(image_src(f))}" width="{ref.width}" height="{ref.height}" '
                     f'alt="{_e(caption)} frame {j + 1}" data-index="{j}"{" hidden" if j else ""}>'
                     for j, f in enumerate(ref.frames))
    controls = ('<div class="clipctl"><button type="button" data-clip="play">play</button>'
                '<button type="button" data-clip="prev" title="previous frame">&lsaquo;</button>'
                f'<input type="range" class="clipseek" min="0" max="{n - 1}" value="0" step="1" '
                f'aria-label="{_e(caption)} frame">'
                '<button type="button" data-clip="next" title="next frame">&rsaquo;</button>'
                f'<span class="clipinfo">frame 1 / {n}</span></div>')
    cls = "clip small" if small else "clip"
    return (f'<figure class="{cls}" data-fps="{ref.fps!r}" data-frames="{n}" data-frame="0" '
            f'title="{_e(caption)} ({about})"><div class="frames">{frames}</div>{controls}'
            f"<figcaption>{_e(about)}</figcaption></figure>")


def _with_pictures(text: str, pictures: Sequence[str], *, clips: Sequence[str] = (), readable: bool = False,
                   limit: int | None = None) -> str:
    """`text` escaped, each picture's image pads (with their vision markers) replaced by the next of `pictures`
    (HTML), each clip's video pad by the next of `clips` (players); pads past the last picture or clip (a dump
    written without them) become an `[image]` or `[clip]` chip, pictures and clips past the last pad go at the end.
    `readable` drops chat-template markers; `limit` keeps the last `limit` characters of text (never a picture)."""
    kinds, parts, at = [], [], 0
    for m in _MEDIA.finditer(text):
        kinds.append("image" if m.group("image") else "clip")
        parts.append(text[at : m.start()])
        at = m.end()
    parts.append(text[at:])
    if readable:
        parts = [_SPECIAL.sub("", p) for p in parts]
        parts[-1] = parts[-1].rstrip()
    if limit is not None:
        keep, out = limit, []
        for part in reversed(parts):
            out.append(part[-keep:] if keep > 0 else "")
            keep -= len(part)
        trimmed = list(reversed(out))
        if trimmed != parts:
            first = next(k for k, (a, b) in enumerate(zip(trimmed, parts)) if a != b)
            trimmed[first] = "\u2026" + trimmed[first]
        parts = trimmed
    html_parts = []
    placed = {"image": 0, "clip": 0}
    media = {"image": pictures, "clip": clips}
    chips = {"image": '<span class="tok imgpad">[image]</span>', "clip": '<span class="tok vidpad">[clip]</span>'}
    for k, part in enumerate(parts):
        if k:
            kind = kinds[k - 1]
            items, at = media[kind], placed[kind]
            html_parts.append(items[at] if at < len(items) else chips[kind])
            placed[kind] += 1
        html_parts.append(_e(part))
    html_parts.extend(pictures[placed["image"]:])
    html_parts.extend(clips[placed["clip"]:])
    return "".join(html_parts)


def _tokens(turn: Turn, figures: Sequence[str] = (), players: Sequence[str] = ()) -> str:
    """The turn's tokens coloured by loss mask; the observation's pictures (`figures`, HTML) in place of their pads,
    its clips (`players`, HTML, one per `turn.clips`) after the clip's first video-pad row."""
    if not turn.tokens:
        return (f'<div class="tokens"><span class="tok m1">{_e(turn.model_text)}</span>'
                f'<span class="tok m0">{_with_pictures(turn.observation_text, figures, clips=players)}</span></div>')
    parts = []
    teacher = turn.teacher_logprobs or (None,) * len(turn.tokens)
    at_row: dict[int, list[str]] = {}
    unplaced = []
    for ref, player in zip(turn.clips, players):
        (at_row.setdefault(ref.row, []) if ref.row is not None else unplaced).append(player)
    placed = 0
    for k, ((text, mask, logprob, count), teacher_lp) in enumerate(zip(turn.tokens, teacher)):
        title = f"loss mask {mask}" + ("" if logprob is None else f", log p = {logprob:.4f}")
        if teacher_lp is not None:  # on-policy distillation: the teacher's beside the student's
            title += f", teacher log p = {teacher_lp:.4f}"
        if text == IMAGE_PAD:
            parts.append(f'<span class="tok imgpad m{mask}" title="{title}">[image x{count}]</span>')
            if placed < len(figures):
                parts.append(figures[placed])
                placed += 1
        elif text == VIDEO_PAD:
            parts.append(f'<span class="tok vidpad m{mask}" title="{title}">[video x{count}]</span>')
            parts.extend(at_row.pop(k, ()))
        else:
            parts.append(f'<span class="tok m{mask}" title="{_e(title)}">{_e(text)}</span>')
    parts.extend(figures[placed:])
    parts.extend(p for row in sorted(at_row) for p in at_row[row])  # rows past the tokens (never, in a valid dump)
    parts.extend([*players[len(turn.clips):], *unplaced])
    return f'<div class="tokens">{"".join(parts)}</div>'


def _turn(turn: Turn, image_src: ImageSrc, number: int) -> str:
    meta = [f"model tokens {turn.model_tokens}", f"observation tokens {turn.observation_tokens}"]
    for label, value in (("finish", turn.finish_reason), ("weight version", turn.weight_version),
                         ("engine", None if turn.engine_latency_s is None else f"{turn.engine_latency_s:.3f} s"),
                         ("env", None if turn.env_latency_s is None else f"{turn.env_latency_s:.3f} s"),
                         ("env retries", turn.env_retries), ("truncation", turn.truncation_cause)):
        if value is not None:
            meta.append(f"{label} {value}")
    figures = [_figure(ref, image_src, f"turn {number} observation picture {k}") for k, ref in enumerate(turn.images)]
    players = [_player(ref, image_src, f"turn {number} observation clip {k}") for k, ref in enumerate(turn.clips)]
    error = f'<div class="err">{_e(turn.error)}</div>' if turn.error else ""
    return (f'<div class="turn" data-turn="{number}"><h4>Turn {number}</h4><div class="meta">{_e(", ".join(meta))}</div>'
            f"{_tokens(turn, figures, players)}{error}</div>")


def episode_id(source: Source, ep: Episode) -> str:
    """The element id of one episode of a source (a page's `#ID` link opens it)."""
    return f"{source.key}:g{ep.group_index}-i{ep.index}"


def _episode(ep: Episode, image_src: ImageSrc, element_id: str = "") -> str:
    flags = (f'data-failed="{int(ep.failed)}" data-truncated="{int(ep.truncated)}" '
             f'data-zero="{int(ep.zero_reward)}"')
    reward = "none" if ep.reward is None else f"{ep.reward:.3f}"
    meta = (f"reward {reward} | status {ep.status.upper()} | termination {ep.termination or '-'} | turns "
            f"{len(ep.turns)} | weight versions {', '.join(ep.weight_versions) or '-'} | env retries {ep.retries} | "
            f"label {str(ep.label)[:80]}")
    prompt_figs = [_figure(ref, image_src, f"prompt picture {k}") for k, ref in enumerate(ep.prompt_images)]
    prompt_clips = [_player(ref, image_src, f"prompt clip {k}") for k, ref in enumerate(ep.prompt_clips)]
    errors = "".join(f'<div class="err">{_e(e)}</div>' for e in ep.errors)
    turns = [_turn(t, image_src, k + 1) for k, t in enumerate(ep.turns)]
    turns_html = paged(turns, TURNS_PER_PAGE, "turns") if len(turns) > TURNS_PER_PAGE else "".join(turns)
    ident = f' id="{_e(element_id)}"' if element_id else ""
    return (f'<article class="episode {ep.status}"{ident} {flags}><h3>group {ep.group_index}, sample {ep.index}</h3>'
            f'<div class="meta">{_e(meta)}</div>{errors}<div class="prompt"><pre>'
            f"{_with_pictures(ep.prompt_text, prompt_figs, clips=prompt_clips)}</pre></div>{turns_html}</article>")


def render_source(source: Source, episodes: Sequence[Episode], image_src: ImageSrc) -> str:
    rewards = [e.reward for e in episodes if e.reward is not None]
    mean = f"{sum(rewards) / len(rewards):.3f}" if rewards else "-"
    counts = {s: sum(e.status == s for e in episodes) for s in sorted({e.status for e in episodes})}
    summary = f"{len(episodes)} episodes, mean reward {mean}, " + ", ".join(f"{k} {v}" for k, v in counts.items())
    body = paged([_episode(e, image_src, episode_id(source, e)) for e in episodes], EPISODES_PER_PAGE, "episodes")
    return (f'<section class="source" id="{_e(source.key)}" data-source="{_e(source.key)}"><h2>{_e(source.title)}</h2>'
            f'<div class="meta">{_e(source.key)}: {_e(summary)}</div>{body}</section>')


def _compare_cell(ep: Episode | None, image_src: ImageSrc, side: str) -> str:
    """One side of a comparison row: reward and status, then per turn the action text and the observation's
    pictures (thumbnails, in place of their pads), clips (small players) and text."""
    if ep is None:
        return "<td>-</td>"
    reward = "none" if ep.reward is None else f"{ep.reward:.3f}"
    turns = []
    for k, t in enumerate(ep.turns, 1):
        thumbs = [_thumb(ref, image_src, f"{side}: turn {k} observation picture {j}") for j, ref in enumerate(t.images)]
        players = [_player(ref, image_src, f"{side}: turn {k} observation clip {j}", small=True)
                   for j, ref in enumerate(t.clips)]
        obs = _with_pictures(t.observation_text, thumbs, clips=players, readable=True, limit=200)
        action = _SPECIAL.sub("", t.model_text).strip() or "(no text)"
        turns.append(f'<div class="cturn"><b>turn {k}</b> <span class="act">{_e(action)}</span>'
                     + (f'<div class="obs">{obs}</div>' if obs else "") + "</div>")
    errors = "".join(f'<div class="err">{_e(e)}</div>' for e in ep.errors)
    n = len(ep.turns)
    return (f'<td><div class="meta">reward {reward}, {_e(ep.status)}, {n} turn{"" if n == 1 else "s"}</div>{errors}'
            f'{"".join(turns)}</td>')


def render_compare(a: Source, a_eps: Sequence[Episode], b: Source, b_eps: Sequence[Episode],
                   image_src: ImageSrc) -> str:
    """Two eval rounds' episodes on the same prompts (matched by group and sample index), side by side: the prompt
    with its pictures, then per side each turn's action and observation pictures. The rows page."""
    by_key = {(e.group_index, e.index): e for e in b_eps}
    rows = []
    for ep in a_eps:
        other = by_key.get((ep.group_index, ep.index))
        thumbs = [_thumb(ref, image_src, f"prompt picture {k}") for k, ref in enumerate(ep.prompt_images)]
        players = [_player(ref, image_src, f"prompt clip {k}", small=True) for k, ref in enumerate(ep.prompt_clips)]
        prompt = _with_pictures(ep.prompt_text, thumbs, clips=players, readable=True, limit=300)
        rows.append(f'<tr class="crow"><td><div class="meta">group {ep.group_index}, sample {ep.index}</div>'
                    f'<div class="ctext">{prompt}</div></td>{_compare_cell(ep, image_src, a.title)}'
                    f"{_compare_cell(other, image_src, b.title)}</tr>")
    head = f"<tr><th>prompt</th><th>{_e(a.title)}</th><th>{_e(b.title)}</th></tr>"
    table = paged(rows, ROWS_PER_PAGE, "rows", holder="tbody",
                  around=(f'<table class="compare"><thead>{head}</thead>', "</table>"))
    return (f'<section class="source compare" id="compare:{_e(a.key)}|{_e(b.key)}"><h2>Side by side: '
            f'{_e(a.title)} | {_e(b.title)}</h2>{table}</section>')


def render_page(index: RunIndex, sections: Sequence[str], *, current: Sequence[str] = (),
                nav_href: Callable[[Source], str], note: str = "", page_sections: bool = False) -> str:
    """A whole page: navigation over `index`'s sources (`current` highlighted), the filters, the `sections` (paged
    `SOURCES_PER_PAGE` at a time when `page_sections`)."""
    links = []
    for source in index.sources:
        cls = ' class="current"' if source.key in current else ""
        links.append(f'<a{cls} href="{_e(nav_href(source))}">{_e(source.title)}</a>')
    filters = ('<div class="filters">Show only: <label><input type="checkbox" data-filter="failed"> FAILED</label>'
               '<label><input type="checkbox" data-filter="truncated"> TRUNCATED</label>'
               '<label><input type="checkbox" data-filter="zero"> zero reward (&le; 0)</label>'
               ' <span class="meta"><span id="shown"></span> shown</span></div>')
    nav = paged(links, NAV_PER_PAGE, "sources", tag="nav", bottom=False)
    body = paged(sections, SOURCES_PER_PAGE, "sections") if page_sections else "".join(sections)
    return (f'<!doctype html><html><head><meta charset="utf-8"><title>jaxrl-vlm trajectories: {_e(index.root.name)}'
            f'</title><style>{_CSS}</style></head><body><header><b>jaxrl-vlm trajectories</b> {_e(index.root)}'
            f' {_e(note)}</header>{nav}{filters}{body}'
            f"<script>{_SCRIPT}applyFilters();openHash();</script></body></html>")
