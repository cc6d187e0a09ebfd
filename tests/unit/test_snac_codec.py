"""The SNAC codec (services/gpu_worker/codecs/snac_codec.py) and Orpheus' token <-> code map
(shared/specs/orpheus_codes.py), on a tiny random SNAC with snac_24khz's rates (2048 samples a
frame, the same receptive field in frames) and a tiny Orpheus vocab: decode is SNAC's own
`decode`, the streamed chunks concatenate to the full decode, tokens round-trip to codes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from services.gpu_worker.codecs import SnacCodec
from services.gpu_worker.codecs.snac_codec import load_snac, positional_noise
from shared.audio import to_pcm16
from shared.specs.orpheus_codes import CODES_PER_FRAME, OrpheusCodes
from tests.tts_checkpoints import make_orpheus_checkpoint, make_orpheus_tokenizer, make_snac_folder

CODEBOOK = 64


@pytest.fixture(scope="module")
def snac_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_snac_folder(tmp_path_factory.mktemp("snac") / "snac", seed=0, codebook_size=CODEBOOK)


@pytest.fixture(scope="module")
def codec(snac_dir: Path) -> SnacCodec:
    return SnacCodec(snac_dir)


def random_frames(n: int, seed: int = 0, per_frame: tuple[int, ...] = (1, 2, 4)) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, CODEBOOK, n * k) for k in per_frame]


def slice_frames(frames: list[np.ndarray], lo: int, hi: int, per_frame: tuple[int, ...]) -> list[np.ndarray]:
    return [codes[lo * k: hi * k] for codes, k in zip(frames, per_frame)]


def snac_decode(model: torch.nn.Module, frames: list[np.ndarray]) -> torch.Tensor:
    with torch.inference_mode():
        return model.decode([torch.as_tensor(c)[None] for c in frames])[0, 0]


# --- decode is SNAC's own ---------------------------------------------------------------------------

def test_decode_equals_snac_decode_without_noise(tmp_path: Path) -> None:
    """With no noise blocks every mode is deterministic: the folded weights and the module walk
    give snac's `decode` bit for bit."""
    folder = make_snac_folder(tmp_path / "quiet", seed=3, codebook_size=CODEBOOK, noise=False)
    frames = random_frames(5, seed=1)
    expected = snac_decode(load_snac(folder), frames)
    got = SnacCodec(folder).decode(frames)
    assert got.dtype == np.float32 and got.shape == (5 * 2048,)
    assert torch.equal(torch.from_numpy(got), expected)


def test_random_noise_is_snacs_own(codec: SnacCodec, snac_dir: Path) -> None:
    """noise='random' draws torch.randn as SNAC's NoiseBlock does: equal under the same seed."""
    frames = random_frames(3, seed=2)
    model = load_snac(snac_dir)
    torch.manual_seed(7)
    expected = snac_decode(model, frames)
    random_codec = SnacCodec(snac_dir, noise="random")
    torch.manual_seed(7)
    assert torch.equal(torch.from_numpy(random_codec.decode(frames)), expected)
    with pytest.raises(ValueError, match="streaming"):
        random_codec.stream()


def test_positional_noise_is_reproducible_and_standard_normal(codec: SnacCodec, snac_dir: Path) -> None:
    frames = random_frames(4, seed=3)
    first = codec.decode(frames)
    assert np.array_equal(first, codec.decode(frames))
    assert not np.array_equal(first, SnacCodec(snac_dir, noise="off").decode(frames))  # the noise matters
    noise = positional_noise(0, 1, 0, 200_000)
    assert abs(float(noise.mean())) < 0.01 and abs(float(noise.std()) - 1.0) < 0.01
    assert np.array_equal(noise[5000:6000], positional_noise(0, 1, 5000, 1000))  # a function of the position
    assert not np.array_equal(noise[:1000], positional_noise(0, 2, 0, 1000))  # blocks differ


def test_legacy_weight_norm_keys_load_the_same(tmp_path: Path, snac_dir: Path) -> None:
    """A state dict with weight_g / weight_v (as older torch saved SNAC) loads to the same codec."""
    legacy = make_snac_folder(tmp_path / "legacy", seed=0, codebook_size=CODEBOOK, legacy_weight_norm=True)
    assert any(k.endswith("weight_g") for k in torch.load(legacy / "pytorch_model.bin", weights_only=True))
    frames = random_frames(2, seed=4)
    assert np.array_equal(SnacCodec(legacy).decode(frames), SnacCodec(snac_dir).decode(frames))


def test_missing_folder_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        SnacCodec(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"codebook_size": CODEBOOK}))
    with pytest.raises(FileNotFoundError, match="pytorch_model"):
        SnacCodec(tmp_path)


def test_bad_frames_are_refused(codec: SnacCodec) -> None:
    good = random_frames(2)
    assert codec.check_frames(good) == 2
    with pytest.raises(ValueError, match="codebooks"):
        codec.decode(good[:2])
    with pytest.raises(ValueError, match="codebook 2"):
        codec.decode([good[0], good[1], good[2][:-1]])
    with pytest.raises(ValueError, match="outside"):
        codec.decode([good[0], good[1] + CODEBOOK, good[2]])
    assert codec.decode([np.zeros(0, np.int64)] * 3).shape == (0,)


# --- streaming ----------------------------------------------------------------------------------------

def test_receptive_field_of_snac_24khz_rates(codec: SnacCodec) -> None:
    """snac_24khz's rates: a sample depends on 2-3 frames each side; the first sample is final
    once 3 frames have arrived."""
    field = codec.receptive_field
    assert field is not None
    assert (field.left_frames, field.right_frames, field.first_chunk_frames) == (3, 3, 3)
    assert codec.samples_per_frame == 2048 and codec.codes_per_frame == (1, 2, 4)
    assert field.ready(2) == 0 and 0 < field.ready(3) < 2048


def stream_all(codec: SnacCodec, frames: list[np.ndarray], sizes: list[int], min_chunk: int = 1) -> list[np.ndarray]:
    stream = codec.stream(min_chunk_samples=min_chunk)
    chunks, at = [], 0
    for size in sizes:
        chunks.append(stream.push(slice_frames(frames, at, at + size, codec.codes_per_frame)))
        at += size
    chunks.append(stream.finish())
    assert stream.samples_emitted == at * codec.samples_per_frame
    return chunks


def arrival_patterns(n: int) -> list[list[int]]:
    """One frame at a time, all at once, and an irregular pattern with empty pushes."""
    rng = np.random.default_rng(n)
    irregular, left = [], n
    while left:
        size = min(left, int(rng.integers(0, 4)))
        irregular.append(size)
        left -= size
    return [[1] * n, [n], irregular]


@pytest.mark.parametrize("n", [1, 2, 5, 17])
def test_stream_concatenation_equals_full_decode(codec: SnacCodec, n: int) -> None:
    frames = random_frames(n, seed=10 + n)
    full = codec.decode(frames)
    scale = float(np.abs(full).max())
    for sizes in arrival_patterns(n):
        chunks = stream_all(codec, frames, sizes)
        streamed = np.concatenate(chunks)
        assert streamed.shape == full.shape
        np.testing.assert_allclose(streamed, full, rtol=0, atol=1e-4 * scale, err_msg=f"arrivals {sizes}")
        if sizes == [1] * n and n > 3:  # one frame in, about a frame out, 3 frames behind
            assert [len(c) for c in chunks[:3]] == [0, 0, codec.receptive_field.ready(3)]
            assert all(len(c) == 2048 for c in chunks[3:n])


def test_stream_min_chunk_and_no_noise(snac_dir: Path) -> None:
    """min_chunk_samples batches pushes into larger decodes; noise='off' streams exactly too."""
    codec = SnacCodec(snac_dir, noise="off")
    frames = random_frames(9, seed=5)
    chunks = stream_all(codec, frames, [1] * 9, min_chunk=4096)
    sent = [c for c in chunks[:-1] if len(c)]
    assert len(sent[0]) < 4096 and all(len(c) >= 4096 for c in sent[1:])  # the first goes out at once
    full = codec.decode(frames)
    np.testing.assert_allclose(np.concatenate(chunks), full, rtol=0, atol=1e-4 * float(np.abs(full).max()))


def test_stream_misuse_is_refused(codec: SnacCodec) -> None:
    stream = codec.stream()
    assert stream.finish().shape == (0,)  # no frames, no sound
    with pytest.raises(ValueError, match="after finish"):
        stream.push(random_frames(1))
    with pytest.raises(ValueError, match="twice"):
        stream.finish()


def test_to_pcm16() -> None:
    pcm = to_pcm16(np.array([0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -3.0], dtype=np.float32))
    assert np.frombuffer(pcm, dtype="<i2").tolist() == [0, 16384, -16384, 32767, -32767, 32767, -32767]


# --- Orpheus tokens <-> codes -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    from tokenizers import Tokenizer

    path = tmp_path_factory.mktemp("orpheus_tok")
    make_orpheus_tokenizer(path, codebook_size=CODEBOOK)
    return Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab(with_added_tokens=True)


def test_orpheus_ids_follow_the_custom_tokens(vocab: dict[str, int]) -> None:
    oc = OrpheusCodes(vocab, CODEBOOK)
    first = vocab["<custom_token_0>"]
    assert oc.base == vocab["<custom_token_10>"] == first + 10
    assert (oc.start_of_speech, oc.end_of_speech) == (first + 1, first + 2)
    assert (oc.start_of_human, oc.end_of_human, oc.start_of_ai) == (first + 3, first + 4, first + 5)
    assert oc.end_of_text == vocab["<|eot_id|>"]
    assert oc.prompt_ids([7, 8]) == [first + 3, 7, 8, oc.end_of_text, first + 4, first + 5, first + 1]
    assert oc.allowed(0) == (oc.base, oc.base + CODEBOOK)
    assert oc.allowed(6) == (oc.base + 6 * CODEBOOK, oc.base + 7 * CODEBOOK)
    assert oc.allowed(7) == oc.allowed(0) and oc.allowed(13)[1] == vocab[f"<custom_token_{10 + 7 * CODEBOOK - 1}>"] + 1


def test_orpheus_tokens_round_trip_to_frames(vocab: dict[str, int]) -> None:
    oc = OrpheusCodes(vocab, CODEBOOK)
    rng = np.random.default_rng(0)
    codes = [int(c) for c in rng.integers(0, CODEBOOK, 3 * CODES_PER_FRAME + 4)]  # 3 frames and a partial one
    tokens = [oc.to_token(c, k) for k, c in enumerate(codes)]
    assert all(oc.allowed(k)[0] <= t < oc.allowed(k)[1] for k, t in enumerate(tokens))
    assert oc.codes(tokens) == codes and oc.codes(tokens[7:], start=7) == codes[7:]
    c0, c1, c2 = oc.frames(codes)
    frame = np.array(codes[: 3 * CODES_PER_FRAME]).reshape(3, 7)  # [a, b, c, d, e, f, g] per frame
    assert c0.tolist() == frame[:, 0].tolist()
    assert c1.tolist() == frame[:, [1, 4]].reshape(-1).tolist()
    assert c2.tolist() == frame[:, [2, 3, 5, 6]].reshape(-1).tolist()
    assert [len(c) for c in oc.frames(codes[:6])] == [0, 0, 0]


def test_orpheus_invalid_codes_are_refused(vocab: dict[str, int]) -> None:
    oc = OrpheusCodes(vocab, CODEBOOK)
    with pytest.raises(ValueError, match="position 1"):
        oc.to_code(oc.base, 1)  # slot 0's id as the second token of a frame
    with pytest.raises(ValueError):
        oc.to_code(oc.end_of_speech, 0)
    with pytest.raises(ValueError):
        oc.to_code(oc.base + 7 * CODEBOOK, 0)
    with pytest.raises(ValueError):
        oc.frames([CODEBOOK] * 7)
    with pytest.raises(ValueError, match="contiguous"):
        OrpheusCodes({**vocab, "<custom_token_40>": 5}, CODEBOOK)
    with pytest.raises(ValueError, match="contiguous"):
        OrpheusCodes(vocab, CODEBOOK + 1)  # the vocab has too few audio tokens for this codec
    with pytest.raises(ValueError, match="custom_token_0"):
        OrpheusCodes({"<|eot_id|>": 1}, CODEBOOK)


def test_orpheus_tokens_decode_through_the_codec(vocab: dict[str, int], codec: SnacCodec) -> None:
    """End to end on the codec side: audio tokens -> codes -> frames -> sound, streamed as the
    tokens come (a frame each time 7 tokens are in) and whole."""
    oc = OrpheusCodes(vocab, codec.codebook_size)
    rng = np.random.default_rng(1)
    tokens = [int(rng.integers(*oc.allowed(k))) for k in range(5 * CODES_PER_FRAME)]
    full = codec.decode(oc.frames(oc.codes(tokens)))
    stream, chunks = codec.stream(), []
    for at in range(0, len(tokens), CODES_PER_FRAME):
        chunks.append(stream.push(oc.frames(oc.codes(tokens[at: at + CODES_PER_FRAME], start=at))))
    chunks.append(stream.finish())
    np.testing.assert_allclose(np.concatenate(chunks), full, rtol=0, atol=1e-4 * float(np.abs(full).max()))


def test_orpheus_checkpoint(tmp_path: Path) -> None:
    import transformers

    path = make_orpheus_checkpoint(tmp_path / "orpheus", seed=0)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    oc = OrpheusCodes(tok.get_vocab(), CODEBOOK)
    config = transformers.AutoConfig.from_pretrained(path)
    assert config.eos_token_id == oc.end_of_speech == tok.eos_token_id
    assert config.vocab_size == len(tok) and config.hidden_size == 64 and config.num_hidden_layers == 2
    ids = tok("tara: Hello world")["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|begin_of_text|>")
    assert tok.convert_tokens_to_ids("<custom_token_10>") == oc.base
