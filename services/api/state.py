"""The api's shared pieces (settings, tokenizer, chat template, backend, metrics) and the
one way a validated request becomes a running `Generation`, used by every route."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import msgspec
from tokenizers import Tokenizer

from services.api.audio_input import decode_audio_input
from services.api.backend import Backend
from services.api.chat_template import ChatTemplate
from services.api.errors import invalid
from services.api.generation import Generation
from services.api.media import load_image
from services.api.metrics import ApiMetrics
from services.api.settings import ApiSettings
from services.api.validation import GenerateParams, check_token_ids
from services.api.video_input import MAX_VIDEOS, decode_video_input
from shared.detokenize import IncrementalDetokenizer
from shared.frames import GenerateRequest, SamplingParams


class ApiState:
    def __init__(
        self,
        settings: ApiSettings,
        tokenizer: Tokenizer,
        backend: Backend | None = None,
        metrics: ApiMetrics | None = None,
        chat_template: ChatTemplate | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        #: the checkpoint's end-of-sequence ids: one that ends a reply shows no text, even
        #: where the reply keeps its special tokens (a harmony chat's `<|return|>`, as vLLM)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.chat_template = chat_template  # None: the model has none, chat is a 400
        self.created = int(time.time())  # the model card's `created` in /v1/models
        self.metrics = metrics or ApiMetrics(settings.model_name, settings.sample_rate)
        self.backend = backend or Backend(
            api_addr=settings.api_addr,
            reply_to=settings.advertise_addr,
            data_worker_addr=settings.data_worker_addr,
            conductor_addr=settings.conductor_addr,
            control_addr=settings.control_addr,
            status_timeout_s=settings.status_timeout_s,
            model=settings.model_name,
        )

    async def start_generation(self, params: GenerateParams, *, client_id: str, started: float,
                               arrival_time: float | None = None, count_prompt: bool = True,
                               task: str = "generate") -> Generation:
        """Submit to the data worker; raises ApiError (400 a token id out of the vocabulary,
        409 duplicate id, 503 shutting down)."""
        if task != self.settings.task and not (task == "generate" and self.settings.task == "speech"):
            raise invalid("model", task_refusal(self.settings.model_name, self.settings.task, task))
        check_token_ids(params.sampling, self.tokenizer.get_vocab_size(with_added_tokens=True))
        images = await self.load_images(params)
        audios = await self.load_audios(params)
        videos = await self.load_videos(params)
        sampling = self.with_model_defaults(params)
        defaults = self.settings.generation_defaults
        req = GenerateRequest(
            request_id=params.request_id,
            model=self.settings.model_name,
            sampling=sampling,
            reply_to=self.settings.advertise_addr,
            max_tokens=params.max_tokens,
            prompt=params.prompt,
            input_ids=params.input_ids,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            add_special_tokens=params.add_special_tokens,
            audio=params.audio,
            language=params.language,
            task=params.task,
            options=dict(params.options),
            images=list(images),
            audios=list(audios),
            videos=list(videos),
            context=list(params.context),
            cameras=list(params.cameras),
            floats=dict(params.floats),
            max_tokens_default=defaults.max_tokens if params.defaulted is not None else None,
        )
        handle = await self.backend.submit(req)
        return Generation(
            handle,
            IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            self.metrics,
            client_id=client_id,
            started=started,
            prompt_tokens=len(params.input_ids or ()),
            stop=params.stop,
            sampling=sampling,
            count_prompt=count_prompt,
            report_cached=self.settings.prompt_tokens_details,
            eos_ids=self.eos_token_ids,
        )


    def with_model_defaults(self, params: GenerateParams) -> SamplingParams:
        """The request's sampling with the checkpoint's defaults (generation_config.json) in
        the fields its client left out."""
        model = self.settings.generation_defaults.sampling()
        fill = {name: value for name, value in model.items() if name in (params.defaulted or ())}
        return msgspec.structs.replace(params.sampling, **fill) if fill else params.sampling

    async def load_audios(self, params: GenerateParams) -> tuple[bytes, ...]:
        """The audio inputs' files, decoded from base64 and checked (`audio_input.py`); a 400
        naming the first that fails. A model that takes no audio inputs refuses any."""
        refs = params.audio_refs
        if not refs:
            return ()
        if not self.settings.audio_placeholder:
            raise invalid(refs[0].param, f"the served model `{self.settings.model_name}` takes no audio inputs")
        if params.input_ids is not None:
            raise invalid("input_ids", "audio inputs need a text prompt holding the audio placeholder "
                                       f"{self.settings.audio_placeholder!r}, not input_ids")
        policy = self.settings.media_policy()
        if len(refs) > policy.max_images_per_request:
            raise invalid(refs[-1].param, f"{len(refs)} audio inputs in one request; the limit is "
                                          f"{policy.max_images_per_request}")
        return tuple(await asyncio.gather(*(asyncio.to_thread(decode_audio_input, r.data, r.param) for r in refs)))

    async def load_videos(self, params: GenerateParams) -> tuple[bytes, ...]:
        """The video inputs' files, decoded from their data URLs and checked
        (`video_input.py`); a 400 naming the first that fails. A model that takes no video
        inputs refuses any."""
        refs = params.video_refs
        if not refs:
            return ()
        if not self.settings.video_placeholder:
            raise invalid(refs[0].param, f"the served model `{self.settings.model_name}` takes no video inputs")
        if params.input_ids is not None:
            raise invalid("input_ids", "video inputs need a text prompt holding the video placeholder "
                                       f"{self.settings.video_placeholder!r}, not input_ids")
        if len(refs) > MAX_VIDEOS:
            raise invalid(refs[-1].param, f"{len(refs)} video inputs in one request; the limit is {MAX_VIDEOS}")
        return tuple(await asyncio.gather(*(asyncio.to_thread(decode_video_input, r.url, r.param) for r in refs)))

    async def load_images(self, params: GenerateParams) -> tuple[bytes, ...]:
        """The files of the images the request names, fetched and checked (`media.py`), all
        at once; a 400 naming the first part that fails. A model that takes no images
        refuses any, naming the part."""
        refs = params.image_refs
        if not refs or params.images:
            return params.images
        if not self.settings.image_placeholder:
            part = refs[0].param.removesuffix(".image_url.url")
            raise invalid(part, f"the served model `{self.settings.model_name}` takes no images: {part} is an image")
        if params.input_ids is not None:
            raise invalid("input_ids", "images need a text prompt holding the image placeholder "
                                       f"{self.settings.image_placeholder!r}, not input_ids")
        policy = self.settings.media_policy()
        policy.check_image_count(len(refs), refs[-1].param)
        return tuple(await asyncio.gather(*(load_image(r.url, r.param, policy) for r in refs)))


#: the route family of each task, for the refusal of another task's route
TASK_ROUTES = {"generate": "/generate, /v1/completions, /v1/chat/completions, /v1/responses and /v1/messages",
               "embed": "/v1/embeddings",
               "speech": "/v1/audio/speech (and /generate: tokens and audio)",
               "score": "/v1/score and /v1/rerank",
               "act": "/v1/actions",
               "rollout": "/v1/world/rollout",
               "image": "/v1/images/generations and /v1/videos"}


def task_refusal(model: str, served: str, asked: str) -> str:
    """Why a route of task `asked` does not serve a model of task `served` (a 400)."""
    return (f"the served model {model!r} is a {served!r} model: this route is for {asked!r} models; "
            f"it serves {TASK_ROUTES.get(served, served)}")
