"""Qwen3-Omni's speech stage: the talker's prompt from the thinker's finished sequence, and
its frames (a first code from the talker, the rest from the code predictor), as
transformers' `Qwen3OmniMoeForConditionalGeneration.generate(return_audio=True)` builds and
samples them; on paged KV (a "talker" label that grows a row a frame, a "code" label whose
rows are rewritten every frame: scratch).

The talker's prompt (transformers' `_get_talker_user_parts` / `_get_talker_assistant_parts`):
- every user turn's rows (each token whose last `<|im_start|>` is followed by the user role
  id): a text row is `text_projection` of the thinker's input embedding, an image or audio
  row `hidden_projection` of the thinker's hidden state at `accept_hidden_layer`;
- then the last assistant turn's first rows: its three opening tokens' projections, four
  `tts_pad`s, `tts_bos`, the first generated token's, each plus a codec row (zeros for the
  first three, then nothink, think_bos, think_eos, the voice, codec_pad, codec_bos).
Each later step feeds the previous frame's summed code embeddings plus one text row: the
projections of the generated tokens after the first, then `tts_eos`, then `tts_pad` for
ever (so the talker reads the text one token per frame, and knows where it ends).

Positions are transformers' `get_rope_index` over the talker's ids (the user turns' ids, then
`tts_pad` for each opening row): text and audio rows one by one, an image's rows its merged
grid (`shared.specs.vision_lm.mrope_positions`, the thinker's own); a later row r is at
r + the offset in all three.

Sampling is the reference's (runners/omni_talker_sampling.py): the first code's logits with
the 1024 ids past the codes suppressed except `codec_eos`, and transformers' repetition
penalty (1.05) over the first codes so far, then greedy or sampled per request; the code
predictor's codes greedy. A frame is made for each first code
but the last (`codec_eos`, or the one sampled at the cap): the reference runs the predictor
for a code only when it feeds the next step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch

from services.gpu_worker.attention import AttnMetadata, AttnRows, build_metadata
from services.gpu_worker.modeling.speech.qwen3_omni_talker import Qwen3OmniTalker
from services.gpu_worker.runners.omni_talker_sampling import (
    TalkerSampling,
    choose,
    first_code_scores,
    predictor_codes,
)
from shared.specs.qwen3_omni import user_rows
from shared.specs.vision_lm import mrope_positions

#: the assistant turn's tokens the talker's prompt takes (`<|im_start|>`, the role, its
#: newline, then one more); its text rows project the tokens after them
TEXT_FROM = 4



@dataclass(frozen=True)
class TalkerSettings:
    """The ids the talker's prompt is built from (a release's config.json)."""

    speakers: dict[str, int]
    im_start: int
    user: int
    assistant: int
    tts_ids: tuple[int, int, int]  # bos, eos, pad (thinker vocabulary)
    codec_prefix: tuple[int, int, int, int, int]  # nothink, think_bos, think_eos, pad, bos
    codec_eos: int
    multimodal: tuple[int, ...]  # audio, image, video placeholder ids
    accept_hidden_layer: int
    merge: int  # the vision tower's spatial merge
    #: the talker's positions a second of video (`talker_config.position_id_per_seconds`)
    position_id_per_seconds: float = 25.0

    def video_steps(self, seconds: list[float] | None) -> list[int] | None:
        """Each medium's step between temporal positions in the talker's `get_rope_index`
        (seconds a temporal patch spans times its positions a second; 1 for an image,
        whose one temporal patch makes it moot). ValueError where it is not whole."""
        if seconds is None:
            return None
        steps = [sec * self.position_id_per_seconds for sec in seconds]
        if any(step != int(step) for step in steps):
            raise ValueError(f"video temporal steps {steps} are not whole positions")
        return [int(step) for step in steps]

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> TalkerSettings:
        t = config.get("talker_config") or {}
        th = config.get("thinker_config") or {}
        return cls(
            speakers={str(k).lower(): int(v) for k, v in (t.get("speaker_id") or {}).items()},
            im_start=int(config.get("im_start_token_id", 151644)), user=int(config.get("user_token_id", 872)),
            assistant=int(config.get("assistant_token_id", 77091)),
            tts_ids=(int(config.get("tts_bos_token_id", 151672)), int(config.get("tts_eos_token_id", 151673)),
                     int(config.get("tts_pad_token_id", 151671))),
            codec_prefix=(int(t.get("codec_nothink_id", 4203)), int(t.get("codec_think_bos_id", 4204)),
                          int(t.get("codec_think_eos_id", 4205)), int(t.get("codec_pad_id", 4196)),
                          int(t.get("codec_bos_id", 4197))),
            codec_eos=int(t.get("codec_eos_token_id", 4198)),
            multimodal=(int(th.get("audio_token_id", 151646)), int(th.get("image_token_id", 151655)),
                        int(th.get("video_token_id", 151656))),
            accept_hidden_layer=int(t.get("accept_hidden_layer", 18)),
            merge=int((th.get("vision_config") or {}).get("spatial_merge_size", 2)),
            position_id_per_seconds=float(t.get("position_id_per_seconds", 25)))


@dataclass
class TalkerPrompt:
    rows: torch.Tensor  # [P, hidden]: the talker's prompt rows
    trailing: torch.Tensor  # [L, hidden]: the text row each step adds, in order
    pad: torch.Tensor  # [hidden]: the text row of every step past `trailing`
    eos: torch.Tensor  # [hidden]: the text row after the last generated token's
    text_from: int  # the sequence index of the token `trailing[0]` projects
    positions: torch.Tensor  # [3, P]: the prompt rows' M-RoPE positions
    offset: int  # a later row r is at r + offset in all three streams


def user_positions(ids: list[int], s: TalkerSettings) -> list[int]:
    """The prompt positions of every user turn's tokens (transformers' `user_mask`)."""
    return user_rows(ids, s.im_start, s.user)


def text_end(generated: list[int], thinker_eos: tuple[int, ...]) -> int:
    """The text row that is `tts_eos` (pads after it), as transformers places it: at the
    first generated EOS's index, or at the generated length (its comment: "entry j holds
    generated token j + 1"; where the prompt holds part of the assistant turn, as a
    template's empty think block, the rows that index are shifted by it, and the talker
    reads that many fewer of the text's last tokens: the reference's own behaviour)."""
    return next((i for i, t in enumerate(generated) if t in thinker_eos), len(generated))


def text_lead(prompt: list[int], s: TalkerSettings) -> int:
    """Generated tokens the talker's prompt step waits for (`Stage.lead`; its step k waits
    for k more). Text row j projects token `assistant start + TEXT_FROM + j`, and while
    the text goes on, rows before the generated length are never the end marker: row j
    is known once both are past it."""
    return max(0, assistant_start(prompt, s) + TEXT_FROM - len(prompt))


def known_text_rows(prompt_len: int, generated: list[int], text_from: int, ended: bool,
                    thinker_eos: tuple[int, ...]) -> int:
    """How many text rows are known: while the thinker decodes, those `text_lead` says;
    once it ended, every row up to the end marker (which `TalkerRun.extend` adds)."""
    if ended:
        return text_end(generated, thinker_eos)
    return min(len(generated), prompt_len + len(generated) - text_from)


def assistant_start(ids: list[int], s: TalkerSettings) -> int:
    """The last `<|im_start|>` followed by the assistant role id. ValueError if none."""
    for i in range(len(ids) - 2, -1, -1):
        if ids[i] == s.im_start and ids[i + 1] == s.assistant:
            return i
    raise ValueError("the prompt opens no assistant turn: the talker has nothing to speak")


def talker_prompt(model: Qwen3OmniTalker, s: TalkerSettings, embed: Callable[[torch.Tensor], torch.Tensor],
                  sequence: list[int], prompt_len: int, speaker: int, thinker_eos: tuple[int, ...],
                  mm_hidden: torch.Tensor | None = None,
                  grids: list[tuple[int, int, int]] | None = None, ended: bool = True,
                  video_seconds: list[float] | None = None) -> TalkerPrompt:
    """The talker's prompt rows and text rows for the thinker's `sequence` (its prompt's
    `prompt_len` ids, then what it generated: all of it, or, `ended` False, what it has
    generated so far, at least one token: the text rows then stop before the end, and
    `TalkerRun.extend` adds the rest as it comes); `embed`: the thinker's input embeddings;
    `mm_hidden` [prompt rows, thinker hidden]: its hidden states at `accept_hidden_layer`,
    read only at image and audio rows of user turns; `grids`: the prompt's images' and
    videos' (t, h, w) in prompt order; `video_seconds`: the seconds each one's temporal
    patch spans (where the prompt holds a video)."""
    dev = model.codec_head.weight.device
    prompt = sequence[:prompt_len]
    embeds = embed(torch.tensor(sequence, device=dev))
    bos, eos, pad = model.text_projection(embed(torch.tensor(s.tts_ids, device=dev))).unbind(0)
    users = user_positions(prompt, s)
    user_rows = torch.empty(len(users), model.cfg.hidden_size, device=dev, dtype=embeds.dtype)
    mm = [j for j, p in enumerate(users) if prompt[p] in s.multimodal]
    text = [j for j, p in enumerate(users) if prompt[p] not in s.multimodal]
    if mm:
        if mm_hidden is None:
            raise ValueError("the prompt's image or audio rows need the thinker's hidden states")
        user_rows[mm] = model.hidden_projection(mm_hidden[[users[j] for j in mm]])
    if text:
        user_rows[text] = model.text_projection(embeds[[users[j] for j in text]])
    a = assistant_start(prompt, s)
    said = model.text_projection(embeds[a:])  # (said[:TEXT_FROM] open the talker's prompt)
    codec = model.codec_embeds(torch.tensor([*s.codec_prefix[:3], speaker, *s.codec_prefix[3:]], device=dev))
    opening = torch.cat([said[:3], pad.expand(4, -1), bos[None], said[3:4]])
    opening = opening + torch.cat([torch.zeros(3, codec.shape[1], device=dev, dtype=codec.dtype), codec])
    generated = sequence[prompt_len:]
    if ended:
        trailing = torch.cat([said[TEXT_FROM:], eos[None]])
        end = text_end(generated, thinker_eos)
        if end < len(trailing):
            trailing[end] = eos
            trailing[end + 1:] = pad
    else:
        trailing = said[TEXT_FROM:][:len(generated)]
    ids = [prompt[p] for p in users] + [s.tts_ids[2]] * opening.shape[0]
    positions, offset = mrope_positions(ids, s.multimodal[1:], list(grids or []), s.merge,
                                        s.video_steps(video_seconds))
    return TalkerPrompt(torch.cat([user_rows, opening]), trailing, pad, eos, a + TEXT_FROM,
                        torch.from_numpy(positions).to(dev), int(offset))


class TalkerRun:
    """One request's talker stage: its prompt, the first codes sampled so far, the frames
    made, and the talker's last hidden state (what the next frame's code predictor reads)."""

    def __init__(self, prompt: TalkerPrompt, closed: bool = True, sampling: TalkerSampling | None = None) -> None:
        self.p = prompt
        #: how its first codes are picked (greedy unless the request samples)
        self.sampling = sampling or TalkerSampling()
        #: the text rows are all there (the thinker ended, `tts_eos` after its last)
        self.closed = closed
        self.rows = 0  # talker rows in KV
        self.history: list[int] = []  # first codes sampled
        self.frames: list[list[int]] = []
        self.sent = 0  # frames handed to the codec
        self.hidden: torch.Tensor | None = None  # [1, hidden]

    @property
    def started(self) -> bool:
        return self.rows > 0

    def extend(self, text_rows: torch.Tensor | None, ended: bool) -> None:
        """Add the text rows of tokens the thinker generated since (`text_rows` [n, hidden],
        their `text_projection`s), and `tts_eos` once it `ended`."""
        parts = [self.p.trailing] + ([text_rows] if text_rows is not None else [])
        if ended:
            parts.append(self.p.eos[None])
            self.closed = True
        self.p.trailing = torch.cat(parts)

    def next_rows(self, frame_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(this step's talker input rows, their positions [3, n]): the prompt, or the last
        frame's summed code embeddings `frame_rows` [1, hidden] plus the next text row."""
        if not self.started:
            return self.p.rows, self.p.positions
        assert frame_rows is not None
        g = self.rows - self.p.rows.shape[0]
        text = self.p.trailing[g] if g < self.p.trailing.shape[0] else self.p.pad
        pos = torch.full((3, 1), self.rows + self.p.offset, device=text.device, dtype=torch.long)
        return frame_rows + text, pos


class TalkerStep:
    """The talker stage's step over a batch of requests, each with its pages: the code
    predictor makes the frame of each started request's last first code (batched, a row
    per request per code, in the "code" pages, rewritten each frame), then one talker
    forward runs every request's rows (a prompt, or that frame plus a text row) and samples
    each request's next first code."""

    def __init__(self, model: Qwen3OmniTalker, s: TalkerSettings, talker_caches: list[torch.Tensor],
                 code_caches: list[torch.Tensor], page_size: int) -> None:
        self.m, self.s = model, s
        self.talker_caches, self.code_caches, self.page_size = talker_caches, code_caches, page_size
        #: where the caches live: off the CPU, torch's attention over metadata moved there
        self.device = talker_caches[0].device

    def _meta(self, rows: list[AttnRows]) -> AttnMetadata:
        if self.device.type == "cpu":
            return build_metadata(rows, self.page_size)
        return build_metadata(rows, self.page_size, backend="torch").to(self.device)

    def __call__(self, runs: list[TalkerRun], pages: list[list[int]], code_pages: list[list[int]]) -> list[int]:
        """Each run's next first code; the frames made are appended to `run.frames`."""
        dev = self.m.codec_head.weight.device
        started = [i for i, r in enumerate(runs) if r.started]
        frame_rows: dict[int, torch.Tensor] = {}
        if started:
            hidden = torch.cat([cast(torch.Tensor, runs[i].hidden) for i in started])
            firsts = [runs[i].history[-1] for i in started]
            frames = self.predict(hidden, firsts, [code_pages[i] for i in started], [runs[i].sampling for i in started])
            embeds = self.m.frame_embeds(torch.tensor(frames, device=dev))
            for j, i in enumerate(started):
                runs[i].frames.append(frames[j])
                frame_rows[i] = embeds[j: j + 1]
        xs, poss, attn, last = [], [], [], []
        for i, r in enumerate(runs):
            x, pos = r.next_rows(frame_rows.get(i))
            attn.append(AttnRows(pages[i], 0, r.rows, x.shape[0], r.started))
            xs.append(x)
            poss.append(pos)
            last.append(sum(t.shape[0] for t in xs) - 1)
        meta = self._meta(attn)
        hidden = self.m.talk(torch.cat(xs), torch.cat(poss, dim=1), self.talker_caches, meta)[last]
        logits = self.m.first_code_logits(hidden)
        out = []
        for j, r in enumerate(runs):
            r.rows += xs[j].shape[0]
            r.hidden = hidden[j: j + 1]
            r.history.append(self._first_code(logits[j], r))
            out.append(r.history[-1])
        return out

    def _first_code(self, logits: torch.Tensor, run: TalkerRun) -> int:
        """The run's next first code (`omni_talker_sampling`: greedy or sampled)."""
        return choose(first_code_scores(logits, run.history, self.s.codec_eos, run.sampling.params), run.sampling)

    def predict(self, hidden: torch.Tensor, firsts: list[int], pages: list[list[int]],
                samplings: list[TalkerSampling] | None = None) -> list[list[int]]:
        """Frames [b][groups]: each first code and the code predictor's `groups - 1` codes
        after it (greedy, or sampled where its run samples: `predictor_codes`), from the
        talker's hidden states `hidden` [b, hidden]."""
        b, dev = len(firsts), hidden.device
        codes = [torch.tensor(firsts, device=dev)]
        for k in range(self.m.groups - 1):
            if k == 0:  # the talker's hidden state and the first code's embedding, positions 0 and 1
                x = torch.stack([hidden, self.m.codec_embeds(codes[0])], dim=1).reshape(2 * b, -1)
                cached, new, rows = 0, 2, torch.arange(1, 2 * b, 2, device=dev)
            else:
                x, cached, new, rows = self.m.residual_embeds(codes[-1], k), k + 1, 1, torch.arange(b, device=dev)
            meta = self._meta([AttnRows(p, 0, cached, new, k > 0) for p in pages])
            pos = torch.arange(cached, cached + new, device=dev).repeat(b)
            codes.append(predictor_codes(self.m.predict(x, pos, self.code_caches, meta, rows, k), samplings))
        return torch.stack(codes, dim=1).tolist()
