"""A tiny random Qwen3-Omni checkpoint (`Qwen3OmniMoeForConditionalGeneration`) in the Hub's
layout: one folder with the thinker's, the talker's, its code predictor's and Code2Wav's
weights (`thinker.*`, `talker.*`, `code2wav.*`), the tokenizer with the omni tokens, and the
processor's files (preprocessor_config.json with the Whisper feature extractor's and the
image processor's settings, as the release keeps them), so transformers'
`Qwen3OmniMoeProcessor` loads from the folder; and transformers' processor over it (the
reference's inputs)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from tests.checkpoints import make_tokenizer

#: Qwen3-Omni's chat template reduced to what these tests send (user turns of text, image,
#: video and audio parts): parts render as the release's tags, which the processor expands
OMNI_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'audio' or 'audio' in content %}"
    "<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
OMNI_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
                 "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>"]
#: the talker's voices (`talker_config.speaker_id`, codec ids past the 32 codes a codebook)
OMNI_SPEAKERS = {"ethan": 40, "chelsie": 41}
#: the tokenizer's named multimodal tokens (transformers reads them from tokenizer_config.json)
OMNI_NAMED = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "audio_token": "<|audio_pad|>",
              "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
              "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"}
#: the release's preprocessor_config.json, images shrunk: Qwen2-VL's image processor (16 px
#: patches merged 2 x 2, mean and std 0.5) and Whisper's feature extractor (128 mel bins)
OMNI_PREPROCESSOR = {
    "chunk_length": 300, "dither": 0.0, "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 128,
    "hop_length": 160, "n_fft": 400, "n_samples": 4800000, "nb_max_frames": 30000, "padding_side": "right",
    "padding_value": 0.0, "return_attention_mask": True, "sampling_rate": 16000,
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessor",
    "merge_size": 2, "patch_size": 16, "temporal_patch_size": 2, "rescale_factor": 0.00392156862745098,
    "resample": 3, "size": {"longest_edge": 96 * 96, "shortest_edge": 32 * 32},
    "processor_class": "Qwen3OmniMoeProcessor",
}
#: a tower of 16 px patches merged 2 x 2, three blocks, deepstack after blocks 0 and 1
OMNI_VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=16,
                   spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64,
                   hidden_act="gelu_pytorch_tanh", deepstack_visual_indexes=[0, 1], initializer_range=0.2)
#: an audio encoder of two layers; conv windows of 2 x n_window mel frames (the release's
#: n_window 50: 1 s, 13 rows; transformers' length formula assumes it) and attention windows
#: of n_window_infer frames (200: 2 s, 26 rows), so a 2.3 s clip spans several of both
OMNI_AUDIO = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                  output_dim=64, n_window=50, n_window_infer=200, downsample_hidden_size=8, max_source_positions=200,
                  conv_chunksize=500, initializer_range=0.2)


def _omni_tokenizer(path: Path) -> Any:
    """make_tokenizer's Qwen2 BPE plus the omni tokens (special added tokens), with the template."""
    from tokenizers import AddedToken, Tokenizer

    make_tokenizer(path, family="qwen3")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in OMNI_SPECIALS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2TokenizerFast", "eos_token": "<|im_end|>", "bos_token": None,
        "pad_token": "<|endoftext|>", "chat_template": OMNI_CHAT_TEMPLATE, "model_max_length": 4096,
        "extra_special_tokens": OMNI_NAMED,
    }))
    return tok


def omni_processor(path: Path) -> Any:
    """transformers' Qwen3OmniMoeProcessor over the folder's tokenizer, image processor (the
    Pil one) and feature extractor, without its video half: the video processor's class
    needs torchvision, and images and audio never reach it."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    features = transformers.WhisperFeatureExtractor.from_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)

    class NoVideo(transformers.Qwen3OmniMoeProcessor):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return NoVideo(image_processor, None, features, tokenizer, chat_template=OMNI_CHAT_TEMPLATE)


def _configs(tok: Any) -> dict[str, Any]:
    """The four parts' configs: a thinker whose text model is Qwen3-MoE's (3 layers, the
    middle one dense), a talker, a code predictor and Code2Wav as small as they build."""
    ids = {name: tok.token_to_id(t) for name, t in
           (("eos", "<|im_end|>"), ("pad", "<|endoftext|>"), ("image", "<|image_pad|>"), ("video", "<|video_pad|>"),
            ("audio", "<|audio_pad|>"), ("audio_start", "<|audio_start|>"), ("vision_start", "<|vision_start|>"),
            ("im_start", "<|im_start|>"), ("tts_pad", "<tts_pad>"), ("tts_bos", "<tts_text_bos>"),
            ("tts_eos", "<tts_text_eod>"))}
    roles = {role: tok.encode(role).ids[0] for role in ("system", "user", "assistant")}
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=8,
                num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.2, eos_token_id=ids["eos"],
                pad_token_id=ids["pad"],
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})
    thinker = dict(text_config=text, vision_config=dict(OMNI_VISION), audio_config=dict(OMNI_AUDIO),
                   audio_token_id=ids["audio"], image_token_id=ids["image"], video_token_id=ids["video"],
                   audio_start_token_id=ids["audio_start"], vision_start_token_id=ids["vision_start"],
                   position_id_per_seconds=13, initializer_range=0.2)
    # the talker's vocabulary: 32 codes, then 1024 ids transformers' generate never samples
    # but codec_eos (the release's layout: 2048 codes + 1024); its special ids are among them
    predictor = dict(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, num_code_groups=4, initializer_range=0.2)
    talker_text = dict(vocab_size=32 + 1024, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, moe_intermediate_size=16,
                       num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=16, initializer_range=0.2,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                        "mrope_interleaved": True})
    talker = dict(code_predictor_config=predictor, text_config=talker_text, num_code_groups=4, thinker_hidden_size=64,
                  accept_hidden_layer=1, codec_eos_token_id=34, codec_nothink_id=35, codec_think_bos_id=36,
                  codec_think_eos_id=37, codec_pad_id=32, codec_bos_id=33, speaker_id=dict(OMNI_SPEAKERS),
                  audio_token_id=ids["audio"],
                  image_token_id=ids["image"], video_token_id=ids["video"], vision_start_token_id=ids["vision_start"],
                  audio_start_token_id=ids["audio_start"], spatial_merge_size=2, initializer_range=0.2)
    code2wav = dict(codebook_size=32, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
                    intermediate_size=48, num_hidden_layers=1, num_quantizers=4, decoder_dim=16,
                    upsample_rates=[2, 2], upsampling_ratios=[2, 2], sliding_window=8,
                    initializer_range=0.2)
    return dict(thinker_config=thinker, talker_config=talker, code2wav_config=code2wav,
                im_start_token_id=ids["im_start"], im_end_token_id=ids["eos"], tts_pad_token_id=ids["tts_pad"],
                tts_bos_token_id=ids["tts_bos"], tts_eos_token_id=ids["tts_eos"], system_token_id=roles["system"],
                user_token_id=roles["user"], assistant_token_id=roles["assistant"])


def make_omni_checkpoint(path: Path, seed: int = 0) -> Path:
    """Save a tiny random Qwen3-Omni checkpoint in `path` (see the module docstring): random
    biases and norm weights (HF inits them to 0 or 1, which would hide those paths), q and k
    norms of about 3 so attention is sharp enough that wrong positions change the greedy
    tokens, and the processor's preprocessor_config.json."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    tok = _omni_tokenizer(path)
    cfg = transformers.Qwen3OmniMoeConfig(**_configs(tok))
    torch.manual_seed(seed)
    model = transformers.Qwen3OmniMoeForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.2)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.normal_(3.0, 0.3)
            elif ("norm" in name or "ln_" in name) and name.endswith(".weight"):
                param.normal_(1.0, 0.2)
            elif name.endswith("pos_embed.weight"):
                param.normal_(0.0, 0.5)
            elif name.startswith("talker.") and ".experts." in name:
                param.normal_(0.0, 0.02)  # transformers leaves the talker's experts uninitialized (torch.empty)
        _unsaturated_code2wav(model.code2wav)
    model.config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    model.save_pretrained(path, safe_serialization=True)
    (path / "preprocessor_config.json").write_text(json.dumps(OMNI_PREPROCESSOR, indent=2))
    return path


def _unsaturated_code2wav(c2w) -> None:
    """Scale Code2Wav's last convolution so its random output sits mostly inside [-1, 1]
    (std ~0.3) rather than at the clamp: a clamped waveform hides the codes and the voice
    (two voices' clips could be all +-1 alike)."""
    import torch

    codes = torch.randint(0, c2w.config.codebook_size, (1, c2w.config.num_quantizers, 24),
                          generator=torch.Generator().manual_seed(5))
    hidden = c2w.code_embedding(codes + c2w.code_offset).mean(1)
    hidden = c2w.pre_transformer(inputs_embeds=hidden).last_hidden_state.permute(0, 2, 1)
    for blocks in c2w.upsample:
        for block in blocks:
            hidden = block(hidden)
    for block in c2w.decoder:
        hidden = block(hidden)
    last = c2w.decoder[-1].conv
    factor = 0.3 / float(hidden.std())
    last.weight.mul_(factor)
    if last.bias is not None:
        last.bias.mul_(factor)


def tone(seconds: float, sr: int = 16000, f0: float = 220.0, seed: int = 0) -> np.ndarray:
    """A rising tone with a little noise (float32 mono), so every mel bin varies."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    wave = 0.4 * np.sin(2 * np.pi * (f0 + 300.0 * t) * t) + 0.02 * rng.standard_normal(t.size)
    return wave.astype(np.float32)


def wav_bytes(samples: np.ndarray, sr: int = 16000) -> bytes:
    """16-bit PCM WAV of float samples."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()
