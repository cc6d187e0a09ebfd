"""`python -m bench speech --family F`: one driver for every speech family, each against its
reference package's one-at-a-time generation (Orpheus and CSM: bench/speech.py and
bench/speech_csm.py hold their checkpoints and references; the others' are here).

Each family's bench checkpoint is random and made as its tests make it (tests/*_checkpoints.py,
their tiny configs; Higgs' backbone a little wider and its EOS not lifted), once, under the bench cache. Every
request speaks the same sentence (Qwen3-Omni: answers one chat turn, text then speech),
greedy where the reference can be (Chatterbox: its sampling defaults, seeded), for
`--frames` frames (Higgs: frames including its BOS and delay frames; Chatterbox: speech
tokens; Qwen3-Omni: text tokens, its talker speaking up to 8 frames a token).

Figures, rounds alternating the two systems (medians, spreads, per-round ratios):
- TTFA: request to the first sound. mstar: a streamed request's first audio bytes
  (`/v1/audio/speech` raw pcm; Qwen3-Omni: the first `delta.audio` of a streamed chat);
  the reference: its whole call (generate, then its codec), as its scripts give sound;
- real-time factor (wall time / audio seconds; below 1 is faster than real time) of one
  request, and of `--concurrency` at once (mstar: concurrent requests; the reference one
  after the other);
- Qwen3-Omni: also the time to the whole text (mstar: the last `delta.content`; the
  reference: the thinker's `generate` alone), which mstar's first audio beats (the talker
  starts at the thinker's first token).

References: transformers for Higgs (`generate` + `HiggsAudioV2Processor.decode`) and
Qwen3-Omni (`generate(..., return_audio=True)`), in process; `qwen-tts` and
`chatterbox-tts` in their own venvs (bench/speech_reference.py, a subprocess a round: its
model loads outside the timings, and a first request warms it).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.checkpoints import cache_dir
from bench.report import results_dir
from bench.server import MstarServer
from bench.side_by_side import Figure, report
from bench.speech_client import GREEDY, TEXT, mstar_one, omni_one
from bench.speech_timing import Reference

RATE = 24000  # every family here speaks at 24 kHz
#: Qwen3-Omni's chat turn (tests/e2e/test_omni_speech.py's)
OMNI_MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello to the world"}]
HIGGS_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64)


@dataclass
class Family:
    """What differs between the families: the checkpoint, the request, the reference."""

    title: str
    reference_name: str
    make: Callable[[Path], None] | None  # the checkpoint into a fresh folder (None: `checkpoint`)
    reference: Callable[[Path, int], Reference]
    #: the cached checkpoint, for the families whose module keeps its own (Orpheus, CSM)
    checkpoint: Callable[[], Path] | None = None
    body: Callable[[int], dict] = lambda frames: {"max_tokens": frames, "temperature": 0}
    serve_args: tuple[str, ...] = ("--num-kv-pages", "512", "--page-size", "16", "--max-seq-len", "512")
    concurrency: int = 8
    frames: int = 24  # --frames' default
    version: str = "v1"  # of the cached checkpoint: a new one when `make` changes
    env: Callable[[Path], dict[str, str]] = field(default=lambda folder: {})


class VenvReference(Reference):
    """bench/speech_reference.py in the package's venv, a subprocess a round (plus a warm-up)."""

    def __init__(self, family: str, python: Path, folder: Path, frames: int) -> None:
        self.family, self.python, self.folder, self.frames = family, python, folder, frames

    def warm(self) -> None:
        """(each round's subprocess warms itself)"""

    def many(self, k: int) -> list[dict]:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"}
        env.pop("PYTHONPATH", None)
        script = Path(__file__).with_name("speech_reference.py")
        proc = subprocess.run([str(self.python), str(script), self.family, str(self.folder), TEXT, str(self.frames),
                               str(k + 1)], capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"bench/speech_reference.py {self.family} failed:\n{proc.stderr[-4000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])[1:]


class HiggsReference(Reference):
    """transformers' greedy Higgs `generate` (RAS off, as the tests run it), then the
    processor's decode with the codec."""

    def __init__(self, folder: Path, frames: int) -> None:
        import torch
        import transformers

        from tests.higgs_checkpoints import _codec_class, higgs_prompt_ids

        self.model = transformers.HiggsAudioV2ForConditionalGeneration.from_pretrained(folder).eval()
        self.processor = object.__new__(transformers.HiggsAudioV2Processor)
        self.processor.audio_stream_bos_id, self.processor.audio_stream_eos_id = 1024, 1025
        self.processor.audio_tokenizer = _codec_class()[1].from_pretrained(hub_cache_folder_of(folder)).eval()
        self.ids = torch.tensor([higgs_prompt_ids(folder, TEXT)])
        self.frames = frames

    def one(self) -> dict:
        import torch

        t0 = time.perf_counter()
        with torch.inference_mode():
            frames = self.model.generate(input_ids=self.ids, max_new_tokens=self.frames, do_sample=False,
                                         ras_win_len=None)
            wave = self.processor.decode(frames)
        return {"wall": time.perf_counter() - t0, "audio_s": wave.shape[-1] / RATE}


class OmniReference(Reference):
    """transformers' Qwen3-Omni `generate(..., return_audio=True)` (greedy thinker and
    talker, the thinker held to `tokens` tokens), and for the text's time the same call
    without audio (the thinker alone)."""

    def __init__(self, folder: Path, tokens: int) -> None:
        import torch
        import transformers

        from shared.specs.qwen3_omni import FRAMES_PER_TOKEN
        from tests.omni_checkpoints import omni_processor

        self.model = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder,
                                                                                      dtype=torch.float32).eval()
        proc = omni_processor(folder)
        text = proc.apply_chat_template(OMNI_MESSAGES, add_generation_prompt=True, tokenize=False)
        self.inputs = proc(text=text, return_tensors="pt")
        self.kwargs = dict(speaker="ethan", thinker_max_new_tokens=tokens, thinker_min_new_tokens=tokens,
                           thinker_do_sample=False, talker_do_sample=False,
                           talker_max_new_tokens=FRAMES_PER_TOKEN * tokens + 1)

    def one(self) -> dict:
        import torch

        with torch.inference_mode():
            t0 = time.perf_counter()
            self.model.generate(**self.inputs, **self.kwargs, return_audio=False)
            text_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            _, wav = self.model.generate(**self.inputs, **self.kwargs, return_audio=True)
        return {"wall": time.perf_counter() - t0, "audio_s": wav.reshape(-1).shape[0] / RATE, "text_s": text_s}


def _make_higgs(path: Path) -> None:
    """The tests' Higgs, wider, and without their lifted EOS column (which ends a clip within
    a few frames: a bench request should speak all its frames)."""
    from tests import higgs_checkpoints
    from tests.higgs_checkpoints import make_higgs_checkpoint, make_higgs_codec

    make_higgs_codec(hub_cache_folder_of(path))
    lift, higgs_checkpoints.EOS_LIFT = higgs_checkpoints.EOS_LIFT, 1.0
    try:
        make_higgs_checkpoint(path, generation={"do_sample": False}, **HIGGS_SHAPE)
    finally:
        higgs_checkpoints.EOS_LIFT = lift


def hub_cache_folder_of(path: Path) -> Path:
    """Higgs' codec, found by its Hub id in a hub cache beside the checkpoint (HF_HUB_CACHE)."""
    from tests.higgs_checkpoints import hub_cache_folder

    return hub_cache_folder(path / "hub")


def _make_qwen3_tts(path: Path) -> None:
    from tests.qwen3_tts_checkpoints import make_qwen3_tts_checkpoint

    make_qwen3_tts_checkpoint(path, {"do_sample": False, "subtalker_dosample": False})


def _make_chatterbox(path: Path) -> None:
    from tests.chatterbox_checkpoints import make_chatterbox_checkpoint

    make_chatterbox_checkpoint(path)


def _make_omni(path: Path) -> None:
    from tests.omni_checkpoints import make_omni_checkpoint

    make_omni_checkpoint(path)


def _venv(family: str) -> Callable[[Path, int], Reference]:
    def make(folder: Path, frames: int) -> Reference:
        if family == "qwen3_tts":
            from tests.qwen3_tts_checkpoints import reference_python
        else:
            from tests.chatterbox_checkpoints import reference_python
        return VenvReference(family, reference_python(), folder, frames)
    return make


def _orpheus_checkpoint() -> Path:
    from bench.speech import ensure_checkpoint as orpheus

    return orpheus()


def _orpheus_reference(folder: Path, frames: int) -> Reference:
    from bench.speech import OrpheusReference

    return OrpheusReference(folder, 7 * frames)


def _csm_checkpoint() -> Path:
    from bench.speech_csm import ensure_checkpoint as csm

    return csm()


def _csm_reference(folder: Path, frames: int) -> Reference:
    from bench.speech_csm import CsmReference

    return CsmReference(folder, frames)


#: Orpheus: 7 tokens a frame, no penalties (the reference is plain greedy under the code
#: constraint); Chatterbox: the package's sampling defaults (mstar's for the family) and a seed
FAMILIES = {
    "orpheus": Family("random Orpheus-shaped 8x512 + SNAC 24 kHz's shape", "transformers", None,
                      _orpheus_reference, checkpoint=_orpheus_checkpoint, serve_args=(),
                      body=lambda frames: {"max_tokens": 7 * frames, **GREEDY}),
    "csm": Family("random CSM 8x512, depth 4x256, 32 codebooks + Mimi's shape", "transformers", None,
                  _csm_reference, checkpoint=_csm_checkpoint, serve_args=()),
    "higgs": Family("random Higgs Audio v2 4x256 + the tests' tiny codec (24 kHz, 960 samples a frame)",
                    "transformers", _make_higgs, HiggsReference, frames=48, version="v2",
                    env=lambda folder: {"HF_HUB_CACHE": str(folder / "hub")}),
    "qwen3_tts": Family("random Qwen3-TTS CustomVoice (the tests' tiny talker + 12 Hz codec shrunk to 48 "
                        "samples a frame)", "qwen-tts", _make_qwen3_tts, _venv("qwen3_tts")),
    "chatterbox": Family("random Chatterbox (the tests' tiny T3 + S3Gen)", "chatterbox-tts", _make_chatterbox,
                         _venv("chatterbox"), body=lambda frames: {"max_tokens": frames, "seed": 0}),
    "qwen3_omni": Family("random Qwen3-Omni (the tests' tiny thinker, talker, Code2Wav)", "transformers",
                         _make_omni, OmniReference, concurrency=4, frames=12,
                         serve_args=("--num-kv-pages", "512", "--page-size", "8", "--max-batch-tokens", "128")),
}


def ensure_checkpoint(family: str, root: Path | None = None) -> Path:
    """The family's bench checkpoint, made once under the bench cache (a folder renamed
    into place when whole)."""
    root = root or cache_dir()
    path = root / f"{family}-speech-bench-{FAMILIES[family].version}"
    if (path / ".complete").exists():
        return path
    tmp = root / f".{path.name}.{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    make = FAMILIES[family].make
    assert make is not None, family
    make(tmp)
    (tmp / ".complete").touch()
    try:
        tmp.rename(path)
    except OSError:
        pass
    return path


async def mstar_round(family: str, url: str, frames: int, concurrency: int) -> dict:
    """One request alone (TTFA, RTF at c1), then `concurrency` at once (RTF at cN)."""
    fam = FAMILIES[family]

    async def one(client: httpx.AsyncClient) -> dict:
        if family == "qwen3_omni":
            return await omni_one(client, OMNI_MESSAGES, frames)
        ttfa, wall, size = await mstar_one(client, frames, fam.body(frames))
        return {"ttfa": ttfa, "wall": wall, "audio_s": size / 2 / RATE}

    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        first = await one(client)
        t0 = time.perf_counter()
        many = await asyncio.gather(*(one(client) for _ in range(concurrency)))
        wall_n = time.perf_counter() - t0
    out = {"ttfa_s": first["ttfa"], "rtf_c1": first["wall"] / first["audio_s"],
           "rtf_cN": wall_n / sum(m["audio_s"] for m in many), "audio_s": first["audio_s"]}
    if "text_s" in first:
        out["text_s"] = first["text_s"]
    return out


def speech_family(args) -> Path:
    family = args.family
    fam = FAMILIES[family]
    out = results_dir(args.out)
    concurrency, frames = args.concurrency or fam.concurrency, args.frames or fam.frames
    folder = Path(args.model) if args.model else fam.checkpoint() if fam.checkpoint else ensure_checkpoint(family)
    ref = fam.reference(folder, frames)
    print("starting mstar serve ...", file=sys.stderr)
    server = MstarServer(str(folder), out / "logs" / "mstar.log", [*fam.serve_args, *args.serve_arg],
                         env=fam.env(folder)).start()
    runs: dict[str, list[dict]] = {"mstar": [], fam.reference_name: []}
    try:
        asyncio.run(mstar_round(family, server.url, frames, 2))  # warm
        ref.warm()
        for r in range(args.rounds):
            runs["mstar"].append(asyncio.run(mstar_round(family, server.url, frames, concurrency)))
            runs[fam.reference_name].append(ref.round(concurrency))
            print(f"round {r + 1}: {runs}", file=sys.stderr)
    finally:
        server.stop()
    figures = [Figure("time to first audio (ms)", "ttfa_s", 1e3), Figure("real-time factor, c1", "rtf_c1"),
               Figure(f"real-time factor, c{concurrency}", "rtf_cN")]
    if family == "qwen3_omni":
        figures.append(Figure("time to the whole text (ms)", "text_s", 1e3))
    title = f"{fam.title}, {frames} {'text tokens' if family == 'qwen3_omni' else 'frames'} (lower is better)"
    return report(out, runs, figures, fam.reference_name, title,
                  {"mode": "speech", "family": family, "args": vars(args), "model": str(folder)})
