"""Images in prompts (conveyor/multimodal.py, conveyor/models/vision.py) against HF transformers'
LLaVA on the same random weights: the image processing, greedy tokens over prompts with images
(whole, in chunks that cut through an image, beside text-only requests), the prefix cache's
keys, and the errors of bad images."""

from __future__ import annotations

import base64
import io
import json

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.multimodal import ImageProcessor, ImagePrompt, ImageToken, chat_images
from conveyor.sampling_params import InvalidRequestError
from tests.conftest import TINY

PIL = pytest.importorskip("PIL.Image")

IMAGE_TOKEN = 383
SIZE, PATCH = 56, 14  # 16 patches an image
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# LLaVA-1.5-hf's chat template's shape: an image part renders as "<image>" before the text.
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image> "
            "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %} {% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


def build_tiny_llava(out_dir, tower: str = "clip_vision_model", strategy: str = "default", layer=-2,
                     pad: bool = False, seed: int = 11):
    """A random-weight `LlavaForConditionalGeneration` (a tiny CLIP or SigLIP tower of 3 layers,
    the text model of conftest's TINY), a word-level tokenizer with `<image>` (id 383) and a
    chat template, and a `preprocessor_config.json` for 56-pixel images."""
    import transformers as tf
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vision = dict(model_type=tower, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                  image_size=SIZE, patch_size=PATCH)
    config = tf.LlavaConfig(text_config={**TINY, "model_type": "llama"}, vision_config=vision,
                            image_token_index=IMAGE_TOKEN, vision_feature_select_strategy=strategy,
                            vision_feature_layer=layer)
    torch.manual_seed(seed)
    model = tf.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # (HF starts biases and the class embedding at zero or one: make them matter)
        for name, p in model.named_parameters():
            if "vision_tower" in name or "projector" in name:
                p.normal_(0, 0.2 if p.dim() > 1 else 0.5)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, IMAGE_TOKEN)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken("<image>", special=True)])
    assert tok.token_to_id("<image>") == IMAGE_TOKEN
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>", chat_template=TEMPLATE).save_pretrained(out_dir)
    (out_dir / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "LlavaImageProcessor", "do_resize": True, "size": {"shortest_edge": SIZE},
        "do_center_crop": True, "crop_size": {"height": SIZE, "width": SIZE}, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3, "do_pad": pad,
    }))
    return out_dir


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_tiny_llava(tmp_path_factory.mktemp("llava") / "m")


def picture(seed: int, size=(70, 90)):
    """A random RGB picture (width, height), not square: resize and crop matter."""
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8)
    return PIL.fromarray(pixels.numpy(), "RGB")


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def hf_tokens(path, prompts, processor):
    """HF's greedy tokens for (token ids with one image token an image, images)."""
    from transformers import LlavaForConditionalGeneration

    hf = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float64).eval()
    per_image = hf.config.vision_config.image_size // PATCH
    n = per_image**2 + (hf.config.vision_feature_select_strategy == "full"
                        and hf.config.vision_config.model_type == "clip_vision_model")
    out = []
    for ids, images in prompts:
        expanded = [t for tok in ids for t in ([tok] * n if tok == IMAGE_TOKEN else [tok])]
        x = torch.tensor([expanded])
        extra = {"pixel_values": torch.stack([processor(im).values for im in images]).double()} if images else {}
        gen = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0, **extra)
        out.append(gen[0, x.shape[1]:].tolist())
    return out


PROMPTS = [
    ([1, 40, IMAGE_TOKEN, 41, 42, 43], [0]),
    ([1, IMAGE_TOKEN, 50, 51, IMAGE_TOKEN, 52, 53, 54, 55, 56, 57, 58], [1, 2]),  # two images, across blocks
    ([1, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, IMAGE_TOKEN, 77], [3]),
    ([1, 90, 91, 92, 93], []),  # text only, beside the others
]


def requests():
    return [ImagePrompt(ids, tuple(picture(s) for s in seeds)) if seeds else ids for ids, seeds in PROMPTS]


def test_image_processing_matches_hf(tmp_path):
    """HF's LLaVA image processor (PIL backend): resize by the shortest edge, center crop,
    rescale and normalize, with and without padding to a square, on pictures of several shapes."""
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    from conveyor.models.vision import VisionArch

    for pad in (False, True):
        folder = build_tiny_llava(tmp_path / f"pad{pad}", pad=pad)
        v = VisionArch.from_llava(json.loads((folder / "config.json").read_text()), 64)
        ours = ImageProcessor.from_folder(folder, v)
        cfg = json.loads((folder / "preprocessor_config.json").read_text())
        cfg.pop("image_processor_type")
        theirs = LlavaImageProcessorPil(**cfg)
        for i, size in enumerate([(70, 90), (90, 70), (56, 56), (30, 41), (300, 200)]):
            image = picture(i, size)
            want = torch.from_numpy(theirs(image, return_tensors="np")["pixel_values"][0])
            got = ours(image)
            assert got.values.shape == (3, SIZE, SIZE)
            torch.testing.assert_close(got.values, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("tower,strategy,layer", [
    ("clip_vision_model", "default", -2),
    ("clip_vision_model", "full", [-3, -1]),
    ("siglip_vision_model", "full", -1),
])
def test_greedy_tokens_match_hf(tmp_path, tower, strategy, layer):
    """Prompts of one and two images, and one of text only, batched together: HF's greedy tokens,
    over every tower and feature selection LLaVA's config names."""
    path = build_tiny_llava(tmp_path / "m", tower, strategy, layer)
    llm = LLM(str(path), dtype="float64", num_kv_blocks=128)
    want = hf_tokens(path, [(ids, [picture(s) for s in seeds]) for ids, seeds in PROMPTS], llm.engine.image_processor)
    outs = llm.generate(requests(), PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_chunks_through_an_image_and_the_prefix_cache(llava):
    """A prompt read in chunks of 5 tokens (an image's 16 tokens over four steps) gives the
    whole prompt's tokens; the prefix cache shares the blocks of the same image and text, and no
    block of the same text with another image."""
    whole = LLM(str(llava), dtype="float64", num_kv_blocks=128)
    want = [o.outputs[0].token_ids for o in whole.generate(requests(), PARAMS, use_tqdm=False)]
    chunked = LLM(str(llava), dtype="float64", num_kv_blocks=128, prefill_mode="chunked", max_num_batched_tokens=5,
                  enable_prefix_caching=True)
    assert [o.outputs[0].token_ids for o in chunked.generate(requests(), PARAMS, use_tqdm=False)] == want
    ids = [1, IMAGE_TOKEN, *range(100, 140)]  # the image fills the first block: the rest hangs on it
    first = chunked.generate([ImagePrompt(ids, (picture(5),))], PARAMS, use_tqdm=False)[0]
    again = chunked.generate([ImagePrompt(ids, (picture(5),))], PARAMS, use_tqdm=False)[0]
    other = chunked.generate([ImagePrompt(ids, (picture(6),))], PARAMS, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 48
    assert other.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.outputs[0].token_ids != first.outputs[0].token_ids


def test_prompt_forms_and_chat(llava):
    """vLLM's dict prompt, text with `<image>`, and a chat's image parts (a data URL) are the
    same request; n > 1 and beam search carry the images to every choice and beam."""
    llm = LLM(str(llava), dtype="float64", num_kv_blocks=128)
    image = picture(7)
    text = "w40 <image> w41 w42"
    by_text = llm.generate([ImagePrompt(text, (image,))], PARAMS, use_tqdm=False)[0]
    by_dict = llm.generate([{"prompt": text, "multi_modal_data": {"image": image}}], PARAMS, use_tqdm=False)[0]
    assert by_dict.outputs[0].token_ids == by_text.outputs[0].token_ids
    assert by_text.prompt_token_ids.count(IMAGE_TOKEN) == 16
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                             {"type": "text", "text": "w41 w42"}]}]
    chat = llm.chat(messages, PARAMS, use_tqdm=False)[0]
    rendered, images = chat_images(messages, TEMPLATE, ImageToken("<image>", 32000, 576))
    assert rendered[0]["content"] == [{"type": "image"}, {"type": "text", "text": "w41 w42"}] and len(images) == 1
    want = llm.generate([ImagePrompt(llm.tokenizer.apply_chat_template(rendered), (image,))], PARAMS,
                        use_tqdm=False)[0]
    assert chat.outputs[0].token_ids == want.outputs[0].token_ids
    two = llm.generate([ImagePrompt(text, (image,))], SamplingParams(n=2, max_tokens=12, temperature=0.0,
                                                                      ignore_eos=True), use_tqdm=False)[0]
    assert [c.token_ids for c in two.outputs] == [by_text.outputs[0].token_ids] * 2
    from conveyor.beam_search import BeamSearchParams

    beams = llm.beam_search([ImagePrompt(text, (image,))], BeamSearchParams(beam_width=2, max_tokens=4))[0]
    greedy = by_text.outputs[0].token_ids[:4]
    assert any(b.tokens[-4:] == greedy for b in beams.sequences)


def test_bad_images_are_refused_and_the_engine_goes_on(llava, tmp_path, tiny_models):
    llm = LLM(str(llava), dtype="float64", num_kv_blocks=128)
    cases = [
        (ImagePrompt("w40 w41", (picture(0),)), "0 image tokens for 1 images"),
        (ImagePrompt("w40 <image> <image>", (picture(0),)), "2 image tokens for 1 images"),
        (ImagePrompt("w40 <image>", ("data:image/png;base64,not-base64!",)), "not valid base64"),
        (ImagePrompt("w40 <image>", (b"not an image",)), "cannot be read"),
        (ImagePrompt("w40 <image>", (str(tmp_path / "x.png"),)), "allowed_local_media_path"),
        ({"prompt": "w40 <image>", "multi_modal_data": {"audio": b""}}, "reads no audio"),
        ({"prompt": "w40 <image>", "multi_modal_data": {"speech": b""}}, "not 'speech'"),
    ]
    for prompt, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            llm.generate([prompt], PARAMS, use_tqdm=False)
    long = ImagePrompt("w40 " + "<image> " * 40, tuple(picture(i) for i in range(40)))  # 640 tokens > 512
    with pytest.raises(InvalidRequestError, match="tokens per sequence"):
        llm.generate([long], PARAMS, use_tqdm=False)
    assert len(llm.generate([ImagePrompt("w40 <image>", (picture(0),))], PARAMS, use_tqdm=False)) == 1
    text_only = LLM(str(tiny_models["llama"]), dtype="float64", num_kv_blocks=32)
    with pytest.raises(InvalidRequestError, match="reads no images"):
        text_only.generate([ImagePrompt([1, 2, 3], (picture(0),))], PARAMS, use_tqdm=False)


def test_local_files_under_the_allowed_path(llava, tmp_path):
    image = picture(8)
    image.save(tmp_path / "a.png")
    llm = LLM(str(llava), dtype="float64", num_kv_blocks=128, allowed_local_media_path=str(tmp_path))
    a = llm.generate([ImagePrompt("w40 <image>", (f"file://{tmp_path / 'a.png'}",))], PARAMS, use_tqdm=False)[0]
    b = llm.generate([ImagePrompt("w40 <image>", (image,))], PARAMS, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="outside the allowed"):
        llm.generate([ImagePrompt("w40 <image>", (str(tmp_path.parent / "b.png"),))], PARAMS, use_tqdm=False)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_requests_with_images(llava, mode):
    """Six prompts with images in a KV cache too small for all of them at once: preempted
    requests (their images encoded again after a recompute, their K/V swapped back otherwise)
    give the tokens they give alone."""
    prompts = [ImagePrompt(f"w{40 + i} <image> w50 w51 w52", (picture(20 + i),)) for i in range(6)]
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = LLM(str(llava), dtype="float64", num_kv_blocks=128)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, long, use_tqdm=False)]
    tight = LLM(str(llava), dtype="float64", num_kv_blocks=14, preemption_mode=mode, num_swap_blocks=64)
    outs = tight.generate(prompts, long, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert tight.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("engine_process", [False, True])
def test_served_over_http(llava, tmp_path, engine_process):
    """`/v1/chat/completions` with `image_url` parts (a data URL, and an http URL the server
    fetches) gives `LLM.chat`'s tokens and counts the image's tokens in `usage`; a bad image is
    a 400 and the server goes on (its engine in this process or in its own)."""
    import http.server
    import threading

    import httpx

    from tests.server.conftest import ServerProcess, assert_openai_error

    image = picture(9)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    png = buf.getvalue()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path == "/cat.png"
            self.send_response(200 if ok else 404)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            if ok:
                self.wfile.write(png)

        def log_message(self, *args):
            pass

    images = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=images.serve_forever, daemon=True).start()
    site = f"http://127.0.0.1:{images.server_address[1]}"
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                             {"type": "text", "text": "w41 w42"}]}]
    want = LLM(str(llava), dtype="float64", num_kv_blocks=128).chat(messages, PARAMS, use_tqdm=False)[0]
    args = ["--model", str(llava), "--dtype", "float64", "--num-kv-blocks", "128"]
    server = ServerProcess(args + (["--engine-process"] if engine_process else []), tmp_path / "server.log")
    body = {"model": str(llava), "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    try:
        server.wait_ready()
        with httpx.Client(timeout=60.0) as client:
            for url in (data_url(image), f"{site}/cat.png"):
                msgs = [{**messages[0], "content": [{"type": "image_url", "image_url": {"url": url}},
                                                    messages[0]["content"][1]]}]
                r = client.post(server.url + "/v1/chat/completions", json={**body, "messages": msgs, "logprobs": True})
                assert r.status_code == 200, r.text
                got = r.json()
                tokens = [int(e["token"].removeprefix("token_id:")) if e["token"].startswith("token_id:")
                          else llava_token(e["token"]) for e in got["choices"][0]["logprobs"]["content"]]
                assert tokens == want.outputs[0].token_ids
                assert got["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
            for url, param in ((f"{site}/missing.png", "image_url"), ("data:image/png;base64,AAAA", "image")):
                msgs = [{**messages[0], "content": [{"type": "image_url", "image_url": {"url": url}}]}]
                assert_openai_error(client.post(server.url + "/v1/chat/completions", json={**body, "messages": msgs}),
                                    400, param=param)
            r = client.post(server.url + "/v1/chat/completions", json={**body, "messages": messages})
            assert r.status_code == 200, r.text
            item = {"role": "user", "content": [{"type": "input_image", "image_url": data_url(image)},
                                                {"type": "input_text", "text": "w41 w42"}]}
            r = client.post(server.url + "/v1/responses", json={
                "model": str(llava), "input": [item], "max_output_tokens": 12, "temperature": 0.0})
            assert r.status_code == 200, r.text
            text = r.json()["output"][0]["content"][0]["text"]
            assert text.split() == want.outputs[0].text.split()  # (a word-level decoder spaces them its own way)
    finally:
        server.stop()
        images.shutdown()


def llava_token(text: str) -> int:
    """The id of one word of the tests' tokenizer ("w40" -> 40)."""
    return {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "<image>": IMAGE_TOKEN}.get(text) or int(text[1:])


def test_a_hub_config_reads_with_transformers_defaults():
    """llava-hf/llava-1.5-7b-hf's config.json names only what differs from transformers'
    defaults: the text model is Vicuna-7B's shape, the tower CLIP ViT-L/14 at 336 pixels, 576
    tokens an image, the tower's 23 first layers read."""
    from conveyor.models.arch import ArchConfig
    from conveyor.models.vision import LlavaVision

    hub = {"architectures": ["LlavaForConditionalGeneration"], "image_token_index": 32000, "model_type": "llava",
           "pad_token_id": 32001, "projector_hidden_act": "gelu",
           "text_config": {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096,
                           "model_type": "llama", "rms_norm_eps": 1e-05, "vocab_size": 32064},
           "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                             "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                             "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
           "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064}
    arch = ArchConfig.from_hf(hub)
    assert (arch.hidden_size, arch.num_layers, arch.num_heads, arch.intermediate_size) == (4096, 32, 32, 11008)
    assert arch.vocab_size == 32064 and arch.max_position_embeddings == 4096
    v = arch.vision
    assert v is not None and v.tokens_per_image == 576 and v.feature_layers == (23,) and v.hidden_act == "quick_gelu"
    with torch.device("meta"):
        assert len(LlavaVision(v).vision_tower.vision_model.encoder.layers) == 23
    bad = {**hub, "vision_config": {**hub["vision_config"], "model_type": "intern_vit_6b"}}
    with pytest.raises(ValueError, match="vision tower 'intern_vit_6b' is not supported"):
        ArchConfig.from_hf(bad)


def test_two_tensor_parallel_ranks_equal_one(llava):
    """Under tensor parallelism rank 0 encodes the images and sends their embeddings with the
    step: two ranks give one's tokens (the tower whole on each rank, the text model split)."""
    one = LLM(str(llava), dtype="float64", num_kv_blocks=128).generate(requests(), PARAMS, use_tqdm=False)
    two = LLM(str(llava), dtype="float64", num_kv_blocks=128, tensor_parallel_size=2, num_threads=1)
    assert [o.outputs[0].token_ids for o in two.generate(requests(), PARAMS, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in one]


def test_the_encoder_cache_across_requests(llava):
    """A picture in three requests of different text (no prefix to share), then in two choices
    of one in a later call, is encoded once; an engine without the encoder cache gives the same
    tokens and encodes it once a step (the step's images are deduplicated by digest)."""
    image, other = picture(30), picture(31)
    prompts = [ImagePrompt(f"w{40 + i} <image> w50", (image,)) for i in range(3)]
    prompts.append(ImagePrompt("w44 <image>", (other,)))
    two = SamplingParams(n=2, max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = {}
    for tokens in (8192, 0):
        llm = LLM(str(llava), dtype="float64", num_kv_blocks=128, enable_prefix_caching=False,
                  encoder_cache_tokens=tokens)
        outs[tokens] = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        outs[tokens].append([c.token_ids for c in llm.generate([prompts[0]], two, use_tqdm=False)[0].outputs])
        assert llm.engine.runner.images_encoded == (2 if tokens else 3)
    assert outs[8192] == outs[0]


def test_the_server_makes_pixels_before_the_engine(llava):
    """A chat request's data URLs become pixels in the HTTP layer (`fetch_images`, in a thread),
    so the engine receives them ready; a local path stays for the engine to read."""
    import asyncio
    from types import SimpleNamespace

    from conveyor.multimodal import Pixels
    from conveyor.server.protocol import ChatCompletionRequest
    from conveyor.server.serving import ChatCompletionHandler

    llm = LLM(str(llava), dtype="float64", num_kv_blocks=128)
    state = SimpleNamespace(engine=llm.engine, loras={}, model_name="m", tool_parser=None,
                            config=SimpleNamespace(reasoning_parser=None))
    image = picture(40)
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "image_url", "image_url": {"url": "/some/file.png"}}, {"type": "text", "text": "w41"}]}]})
    handler = ChatCompletionHandler(state, body)  # type: ignore[arg-type]
    asyncio.run(handler.fetch_images())
    made, path = handler.prompts()[0].images
    assert isinstance(made, Pixels) and path == "/some/file.png"
    assert made.digest == llm.engine.image_processor(image).digest


def test_allowed_media_domains(llava, tmp_path):
    """vLLM's `allowed_media_domains`: an image URL of a host outside the list is refused by name
    (in the engine and in the server's front end, before anything is fetched), one of a listed
    host is read, and a redirect off the list is refused; without the option, any host."""
    import asyncio
    import http.server
    import threading
    from types import SimpleNamespace

    from conveyor.config import ConfigError
    from conveyor.server.protocol import ChatCompletionRequest
    from conveyor.server.serving import ChatCompletionHandler
    from tests.conftest import build_tiny_model

    image = picture(41)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    png = buf.getvalue()
    fetched: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            fetched.append(self.path)
            if self.path == "/away":  # (to the same server under another host name)
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/cat.png")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args):
            pass

    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{site.server_address[1]}"
    try:
        want = LLM(str(llava), dtype="float32").generate(ImagePrompt([1, IMAGE_TOKEN, 40], (image,)), PARAMS,
                                                         use_tqdm=False)[0].outputs[0].token_ids
        shut = LLM(str(llava), dtype="float32", allowed_media_domains=["example.com"])
        with pytest.raises(InvalidRequestError, match=r"'127\.0\.0\.1' is not among the allowed media domains"):
            shut.generate(ImagePrompt([1, IMAGE_TOKEN, 40], (f"{url}/cat.png",)), PARAMS, use_tqdm=False)
        state = SimpleNamespace(engine=shut.engine, loras={}, model_name="m", tool_parser=None,
                                config=SimpleNamespace(reasoning_parser=None))
        body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"{url}/cat.png"}}, {"type": "text", "text": "w41"}]}]})
        with pytest.raises(InvalidRequestError, match="not among the allowed media domains"):
            asyncio.run(ChatCompletionHandler(state, body).fetch_images())  # type: ignore[arg-type]
        assert fetched == []  # (nothing was fetched)
        listed = LLM(str(llava), dtype="float32", allowed_media_domains=["127.0.0.1"])
        got = listed.generate(ImagePrompt([1, IMAGE_TOKEN, 40], (f"{url}/cat.png",)), PARAMS, use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want
        with pytest.raises(InvalidRequestError, match="'localhost' is not among"):
            listed.generate(ImagePrompt([1, IMAGE_TOKEN, 40], (f"{url}/away",)), PARAMS, use_tqdm=False)
        assert listed.generate([1, 5, 6], PARAMS, use_tqdm=False)[0].outputs[0].token_ids  # (serving goes on)
    finally:
        site.shutdown()
    with pytest.raises(ConfigError, match="reads no images"):
        LLM(str(build_tiny_model(tmp_path / "text", "llama")), dtype="float32", allowed_media_domains=["example.com"])
