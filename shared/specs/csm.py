"""CSM (Sesame's Conversational Speech Model, `CsmForConditionalGeneration`): text in, Mimi
codes out, 32 codebooks a frame at 12.5 frames a second.

Two Llama stacks and a codec, as transformers' `CsmForConditionalGeneration` runs them:
- the backbone reads the prompt (text embeddings) and then one row per audio frame (the sum
  of the frame's codebook embeddings) and samples the frame's first code (`lm_head`);
- the depth decoder writes the frame's other codes: rows [the backbone's last hidden state,
  code 0's embedding, code 1's, ...] at positions 0, 1, ..., each row's head its own
  (`codebooks_head.weight[position - 1]`), `num_codebooks - 1` steps a frame;
- Mimi turns frames into 24 kHz sound (services/gpu_worker/codecs/mimi_codec.py).

KV (DESIGN.md section 3, "Speech out"): label "backbone" (pool "kv") holds the prompt's
rows and grows one row per frame on `frame_loop`; label "depth" (pool "depth") holds one
frame's depth rows as `scratch` (`num_codebooks` rows: the hidden state, then codes 0 to
`num_codebooks - 2`), written every frame and released at the frame's end. Loops:
`frame_loop` (one iteration a frame after the first, which the prompt's step makes; capped
by max_tokens, which counts frames) and `codebook_loop` (`num_codebooks - 1` depth steps a
frame, fixed by the model).

The prompt is the CSM processor's chat template for one `[speaker]text` turn:
`<|begin_of_text|>[{speaker}]{text}<|end_of_text|>`, tokenized without the tokenizer's own
specials (the template writes them). Voices are speaker ids "0" to "9" (`VOICES`; CSM
was trained on conversations whose speakers are numbered, 0 and 1 mostly). A frame whose
codes other than the last are all `codebook_eos_token_id` (0) ends the request, as
transformers' generate stops; it is sent as the token `eos_frame_token` (one past the last
code) and makes no sound unless its last code is not 0 (transformers cuts the audio at the
first all-zero frame only).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from shared.layout import DTYPE_BYTES, KVLabel, LabelLayout, PagedKVConfig, ProcessPromptOutput, Span
from shared.model_config import ModelConfig, read_model_config
from shared.specs.base import MetaValue, ModelSpec, PromptError, PromptRequest, added_tokens

ARCHITECTURE = "CsmForConditionalGeneration"
#: the speakers a request may name (`voice`), as the prompt's `[N]` prefix
VOICES = tuple(str(i) for i in range(10))
DEFAULT_VOICE = "0"
#: the config fields of a CSM stack that are a Llama's (the rest is CSM's own)
LLAMA_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings",
                "rope_parameters", "rope_theta", "rope_scaling", "attention_bias", "mlp_bias")


def llama_config(raw: Mapping[str, Any], vocab_size: int) -> ModelConfig:
    """One of CSM's two stacks as the Llama it is (transformers' `CsmDecoderLayer` is
    Llama's layer), read by the decoder family's one config reader."""
    fields = {k: raw[k] for k in LLAMA_FIELDS if k in raw and raw[k] is not None}
    return read_model_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                              "vocab_size": vocab_size, "tie_word_embeddings": False, **fields})


def mimi_frame(codec: Mapping[str, Any]) -> tuple[int, int]:
    """(sample rate, samples a frame) of a Mimi config: the SEANet's hop times the latent
    downsampling of 2 (1920 at 24 kHz: 12.5 frames a second)."""
    rate = int(codec.get("sampling_rate", 24000))
    return rate, math.prod(int(r) for r in codec.get("upsampling_ratios") or (8, 6, 5, 4)) * 2


class CsmSpec(ModelSpec):
    task = "speech"
    engine = "csm_decoder"
    decode_loop = "frame_loop"
    codebook_loop = "codebook_loop"
    backbone_label = "backbone"
    depth_label = "depth"
    pool = "kv"
    depth_pool = "depth"
    metadata_keys = frozenset({"prompt_len", "voice"})
    #: Sesame's generator's sampling (temperature 0.9, top-k 50), for every codebook
    speech_defaults = (("temperature", 0.9), ("top_k", 50))

    def __init__(self, config: Mapping[str, Any], *, page_size: int, max_seq_len: int = 0,
                 dtype: str = "float32") -> None:
        self.raw = dict(config)
        self.num_codebooks = int(config.get("num_codebooks") or 32)
        self.codebook_vocab = int(config["vocab_size"])
        self.config = llama_config(config, self.codebook_vocab)
        depth = dict(config.get("depth_decoder_config") or {})
        self.depth_config = llama_config(depth, self.codebook_vocab)
        self.codec_config = dict(config.get("codec_config") or {})
        if int(self.codec_config.get("num_quantizers", self.num_codebooks)) != self.num_codebooks:
            raise ValueError(f"the codec has {self.codec_config.get('num_quantizers')} codebooks; "
                             f"the model writes {self.num_codebooks}")
        self.codebook_eos = int(config.get("codebook_eos_token_id") or 0)
        #: the token a frame that ends the request is sent as (one past the last code)
        self.eos_frame_token = self.codebook_vocab
        self.stop_ids = (self.eos_frame_token,)
        self.vocab_size = self.codebook_vocab + 1
        self.text_vocab_size = int(config.get("text_vocab_size") or 0)
        self.sample_rate, self.samples_per_frame = mimi_frame(self.codec_config)
        self.frame_rate = self.sample_rate / self.samples_per_frame
        self.page_size = page_size
        self.dtype = dtype
        ctx = self.config.max_position_embeddings
        self.max_seq_len = min(ctx, max_seq_len) if max_seq_len else ctx
        self.voices = VOICES
        self.bos_id: int | None = None
        #: the folder whose safetensors hold the codec's weights (`codec_model.*`)
        self.codec_path: Path | None = None
        self.eos_text = "<|end_of_text|>"
        self._labels = (KVLabel(self.backbone_label, self.pool, keys=True, grows_on=self.decode_loop),
                        KVLabel(self.depth_label, self.depth_pool))
        #: every backbone layer reads the backbone label (the runner's decoder half)
        self.layer_labels = [self.backbone_label] * self.config.num_hidden_layers

    def load_folder(self, path: str | Path) -> CsmSpec:
        """The template's specials from the tokenizer: its bos and eos tokens."""
        path = Path(path)
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        vocab = added_tokens(path)
        bos, eos = _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token"))
        if bos is None or bos not in vocab or eos is None or eos not in vocab:
            raise ValueError(f"{path}: the tokenizer's bos and eos tokens ({bos!r}, {eos!r}) must be added tokens "
                             "(CSM's template writes them around each turn)")
        self.bos_id, self.eos_text = vocab[bos], eos
        self.codec_path = path
        return self

    # -- what a request is ----------------------------------------------------------------

    def prompt_text(self, text: str, options: Mapping[str, MetaValue]) -> str:
        """`[speaker]text<eos>`: the template's turn without its leading bos, which the
        tokenizer's own specials write (or `process_prompt` adds, for a tokenizer that
        writes none)."""
        voice = options.get("voice") or DEFAULT_VOICE
        if voice not in self.voices:
            raise PromptError("voice", f"voice {voice!r} is not one of this model's speakers: {', '.join(self.voices)}")
        return f"[{voice}]{text}{self.eos_text}"

    def process_prompt(self, request: PromptRequest) -> ProcessPromptOutput:
        if request.audio is not None:
            raise PromptError("file", "the served model does not take audio")
        ids = list(request.token_ids)
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        layouts = {
            self.backbone_label: LabelLayout(spans=(Span.ids(ids),), growth={self.decode_loop: 1}),
            self.depth_label: LabelLayout(spans=(), scratch=self.depth_rows),
        }
        meta: dict[str, MetaValue] = {"prompt_len": len(ids), "voice": str(request.options.get("voice")
                                                                          or DEFAULT_VOICE)}
        return ProcessPromptOutput({"input_ids": np.asarray(ids, dtype=np.int32)}, layouts, meta)

    @property
    def depth_rows(self) -> int:
        """Rows one frame's depth decode writes: the backbone's hidden state and codes 0 to
        `num_codebooks - 2` (the last code is sampled, never fed back)."""
        return self.num_codebooks

    # -- KV and loops -----------------------------------------------------------------------

    @property
    def kv_labels(self) -> tuple[KVLabel, ...]:
        return self._labels

    def paged_pools(self, num_pages: int) -> dict[str, PagedKVConfig]:
        b, d = self.config, self.depth_config
        return {
            self.pool: PagedKVConfig(self.pool, b.num_hidden_layers, b.num_key_value_heads, b.head_dim, self.dtype,
                                     self.page_size, num_pages, self.max_seq_len),
            self.depth_pool: PagedKVConfig(self.depth_pool, d.num_hidden_layers, d.num_key_value_heads, d.head_dim,
                                           self.dtype, self.page_size, num_pages, self.max_seq_len),
        }

    def graph_loops(self) -> dict[str, int]:
        # the prompt's step makes the first frame, so at most max_seq_len - 1 more
        return {self.decode_loop: self.max_seq_len - 1, self.codebook_loop: self.num_codebooks - 1}

    def get_loop_caps(self, max_tokens: int, prompt_len: int | None = None) -> dict[str, int]:
        """`max_tokens` counts frames (12.5 a second); each frame runs the whole codebook loop."""
        return {self.decode_loop: max(1, max_tokens - 1), self.codebook_loop: self.num_codebooks - 1}

    def frames_for(self, seconds: float) -> int:
        """Frames of `seconds` of sound (at least one)."""
        return max(1, math.ceil(seconds * self.frame_rate))

    def bytes_per_page(self, page_size: int) -> int:
        width = DTYPE_BYTES[self.dtype]
        return sum(c.num_hidden_layers * 2 * page_size * c.num_key_value_heads * c.head_dim * width
                   for c in (self.config, self.depth_config))


def _token_str(value: Any) -> str | None:
    """A tokenizer_config special: a string, or an AddedToken dict's content."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
