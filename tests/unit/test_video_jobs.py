"""The api's video jobs (services/api/dialects/openai/videos.py): at most `max_jobs`, an
ended job kept `ttl_s` then gone (404), a full store of running jobs refusing a new one
(429), an ended job making room for a new one; and the MP4 writer's frames decode back."""

from __future__ import annotations

import io

import numpy as np
import pytest

from services.api.dialects.openai import videos
from services.api.errors import ApiError


def _entry(i: int) -> videos.Entry:
    return videos.Entry(videos.VideoJob(f"video_{i}", 0, "m", "p", "1", "32x32"))


def test_jobs_are_bounded_and_expire(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(videos.time, "monotonic", lambda: now[0])
    jobs = videos.VideoJobs(max_jobs=2, ttl_s=10.0)
    a, b = _entry(0), _entry(1)
    jobs.add(a)
    jobs.add(b)
    with pytest.raises(ApiError) as err:
        jobs.add(_entry(2))
    assert err.value.status == 429
    jobs.ended(a)
    jobs.add(_entry(3))  # the ended job makes room
    with pytest.raises(ApiError):
        jobs.get("video_0")
    jobs.ended(b)
    now[0] += 9.0
    assert jobs.get("video_1") is b
    now[0] += 2.0
    with pytest.raises(ApiError) as err:
        jobs.get("video_1")
    assert err.value.status == 404 and err.value.param == "video_id"
    assert jobs.get("video_3").job.status == "queued"


def test_mp4_decodes_to_the_frames():
    import av

    y, x = np.mgrid[0:32, 0:48]
    frames = np.stack([np.stack([(x * 5 + t * 9) % 256, (y * 7) % 256, ((x + y) * 3) % 256], -1)
                       for t in range(5)]).astype(np.uint8)
    with av.open(io.BytesIO(videos.mp4(frames))) as container:
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    assert decoded.shape == frames.shape
    luma = np.array([0.299, 0.587, 0.114])
    assert np.abs(decoded @ luma - frames @ luma).mean() < 2.0
