"""Orpheus text-to-speech: a Llama checkpoint whose added tokens are SNAC codes.

The LLM is the decoder family's (the same labels, pools, loops and kernels); what is
Orpheus' own is what goes in and what comes out:
- in: `"{voice}: {text}"` tokenized as any prompt (`prompt_text`, the data worker's hook),
  then wrapped as Orpheus' own engine wraps it: `<start_of_human>` + ids + `<|eot_id|>`
  `<end_of_human><start_of_ai><start_of_speech>`;
- out: audio tokens, 7 per frame (`shared.specs.orpheus_codes`), until `<end_of_speech>`;
  the gpu worker constrains each to its codebook's range (so every frame is a valid one:
  Orpheus' reference drops invalid codes after the fact) and turns frames into sound with
  the SNAC codec beside the steps (`services/gpu_worker/runners/speech.py`).

The codec is a SNAC folder (config.json + pytorch_model.bin, as hubertsiuzdak/snac_24khz
is on the Hub) at `<model folder>/snac`; its `codebook_size` sets the code ranges (4096 in
the real model; tests shrink it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shared.layout import ProcessPromptOutput
from shared.specs.base import MetaValue, PromptError, PromptRequest, added_tokens
from shared.specs.decoder_lm import DecoderLMSpec
from shared.specs.orpheus_codes import CODES_PER_FRAME, OrpheusCodes

#: Orpheus' English voices (canopylabs/orpheus-3b-0.1-ft)
VOICES = ("tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe")
DEFAULT_VOICE = "tara"
CODEC_FOLDER = "snac"
#: samples of one SNAC 24 kHz frame (hop 512 x the coarsest codebook's stride 4), until the
#: codec's config says otherwise
SNAC_FRAME_SAMPLES = 2048


class OrpheusSpec(DecoderLMSpec):
    task = "speech"
    engine = "speech_decoder"
    int8_kv = False  # speech codes: no measure of int8 KV's effect on the sound yet
    metadata_keys = frozenset({"prompt_len", "voice"})
    #: Orpheus' recommended sampling (its own engine's defaults)
    speech_defaults = (("temperature", 0.6), ("top_p", 0.8), ("repetition_penalty", 1.3))

    def __init__(self, config: Mapping[str, Any], *, page_size: int, max_seq_len: int = 0,
                 dtype: str = "float32") -> None:
        super().__init__(config, page_size=page_size, max_seq_len=max_seq_len, dtype=dtype)
        self.codes: OrpheusCodes | None = None
        self.codec_path: Path | None = None
        self.sample_rate = 24000
        self.audio_frame_rate = self.sample_rate / SNAC_FRAME_SAMPLES
        self.audio_frame_tokens = CODES_PER_FRAME
        self.voices = VOICES

    def load_folder(self, path: str | Path) -> OrpheusSpec:
        """The code layout from the tokenizer's `<custom_token_N>` tokens and the codec's
        codebook size: both must be there, or the model cannot speak."""
        path = Path(path)
        codec = path / CODEC_FOLDER / "config.json"
        if not codec.is_file():
            raise ValueError(f"{path}: no SNAC codec folder at {path / CODEC_FOLDER} (config.json + weights, "
                             "hubertsiuzdak/snac_24khz's files)")
        settings = json.loads(codec.read_text())
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{path}: no tokenizer.json")
        vocab = added_tokens(path)
        self.codes = OrpheusCodes(vocab, int(settings.get("codebook_size", 4096)))
        self.sample_rate = int(settings.get("sampling_rate", 24000))
        # a frame is one code of the coarsest codebook: hop_length samples x its stride
        strides = settings.get("vq_strides") or [SNAC_FRAME_SAMPLES // 512]
        self.audio_frame_rate = self.sample_rate / (int(settings.get("hop_length", 512)) * int(strides[0]))
        self.codec_path = codec.parent
        self.stop_ids = (self.codes.end_of_speech,)
        return self

    def _codes(self) -> OrpheusCodes:
        if self.codes is None:
            raise PromptError("model", "the model folder's codec was not loaded")
        return self.codes

    def prompt_text(self, text: str, options: Mapping[str, MetaValue]) -> str:
        """The text the tokenizer sees: Orpheus' `"{voice}: {text}"`."""
        voice = options.get("voice") or DEFAULT_VOICE
        if voice not in self.voices:
            raise PromptError("voice", f"voice {voice!r} is not one of this model's: {', '.join(self.voices)}")
        return f"{voice}: {text}"

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        codes = self._codes()
        ids = codes.prompt_ids(request.token_ids)
        out = super().process_prompt(PromptRequest(ids, request.audio, request.options))
        out.metadata["voice"] = str(request.options.get("voice") or DEFAULT_VOICE)
        return out

