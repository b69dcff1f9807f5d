"""Write random-weight checkpoints in the real diffusers layout.

No model hub is reachable where StageDiff is built and tested, so tests and benchmarks run on
checkpoints made here: the real classes (diffusers for transformer, VAE and scheduler, transformers
for the text encoder and tokenizer) with their real config keys, random weights saved as
safetensors, and a tokenizer trained locally with the `tokenizers` library. A directory written by
`init_model` loads unchanged with `diffusers.WanPipeline.from_pretrained(out_dir)`, exactly as a
downloaded Wan2.1 checkpoint does, so every stage can be checked against in-process diffusers.

diffusers, transformers and tokenizers are imported where they are used, so importing this module
(as the CLI does) stays cheap.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from services.checkpoint import DEFAULTS_FILE

logger = logging.getLogger(__name__)

FAMILIES = ("wan-t2v",)
PRESETS = ("tiny", "small")

# WanTransformer3DModel (the DiT). Keys are the model's own config keys.
#   patch_size          (t, h, w) patch over the latent video; (1, 2, 2) as in every Wan2.1 model
#   num_attention_heads heads per attention; divisible by 2 and 4 so Ulysses/tensor parallelism can split them
#   attention_head_dim  width of one head; hidden size = heads * head_dim
#   in/out_channels     latent channels, equal to the VAE's z_dim
#   text_dim            width of the text embeddings, equal to the text encoder's d_model
#   freq_dim            sinusoidal timestep embedding width (256 in the real models)
#   ffn_dim             hidden width of each block's feed-forward
#   num_layers          number of transformer blocks
#   cross_attn_norm     layer-norm before cross-attention, as in the real models
#   qk_norm             RMS norm of queries and keys across all heads, as in the real models
#   rope_max_seq_len    longest positional extent (frames, rows, columns of patches) RoPE covers (1024 as in
#                       the real models; its tables are not saved weights)
TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=8,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=64,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=1024,
    ),
    "small": dict(
        patch_size=(1, 2, 2),
        num_attention_heads=8,
        attention_head_dim=48,
        in_channels=16,
        out_channels=16,
        text_dim=128,
        freq_dim=256,
        ffn_dim=1536,
        num_layers=12,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=1024,
    ),
}

# AutoencoderKLWan (the causal 3D VAE). Keys are the model's own config keys.
#   base_dim            channels of the first encoder stage (96 in the real model)
#   z_dim               latent channels
#   dim_mult            channel multiplier per resolution stage
#   num_res_blocks      residual blocks per stage
#   attn_scales         resolutions with spatial attention (none, as in the real model)
#   temperal_downsample which of the three downsamplings also halve time (4x overall, as in the real model)
# latents_mean / latents_std are not fixed here: init_model draws them from the seed (std positive)
# so that the pipeline's de-normalisation of latents is exercised with non-trivial values.
VAE_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        base_dim=8,
        z_dim=16,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
    ),
    "small": dict(
        base_dim=24,
        z_dim=16,
        dim_mult=[1, 2, 4, 4],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],
    ),
}

# UMT5EncoderModel (the text encoder); UMT5Config keys. vocab_size is not set here: it is the size of
# the tokenizer trained by init_model, so every token id has an embedding row.
#   d_model                 hidden width (= the transformer's text_dim)
#   d_kv                    width of one attention head
#   d_ff                    feed-forward hidden width
#   num_layers / num_heads  encoder depth and heads
#   relative_attention_*    T5 relative position buckets
#   feed_forward_proj       gated GELU feed-forward, as in UMT5
#   pad/eos/decoder_start   token ids matching the tokenizer (<pad>=0, </s>=1)
TEXT_ENCODER_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        dense_act_fn="gelu_new",
        is_gated_act=True,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    ),
    "small": dict(
        d_model=128,
        d_kv=32,
        d_ff=256,
        num_layers=4,
        num_heads=4,
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        dense_act_fn="gelu_new",
        is_gated_act=True,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
    ),
}

# The locally trained Unigram tokenizer. The trainer keeps only pieces that win some segmentation of
# the corpus, so a larger vocabulary needs a more varied corpus (more made-up names).
#   vocab_size       target number of pieces, special tokens included (a too-plain corpus ends short)
#   corpus_sentences generated prompt-like sentences to train on
#   corpus_names     distinct made-up proper names used in them (the main source of distinct sub-words)
TOKENIZER_CONFIGS: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=2000, corpus_sentences=6000, corpus_names=2000),
    "small": dict(vocab_size=8000, corpus_sentences=12000, corpus_names=12000),
}

# UniPCMultistepScheduler configured as in the published Wan2.1 diffusers checkpoints.
SCHEDULER_CONFIG: dict[str, Any] = dict(
    num_train_timesteps=1000,
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=3.0,
)

# The request each preset is sized for: WanPipeline keyword arguments. Measured end to end through
# WanPipeline (CFG doubles the transformer calls), best of several runs on a shared 2-core CPU:
#   tiny,  1 thread:  ~0.15 s (transformer ~0.01 s, VAE decode ~0.1 s, text encoder ~0.04 s)
#   small, 2 threads: ~19 s   (transformer 12-13 s = 65-70%, VAE decode ~6 s = 30-33%, text encoder 0.05 s)
DEFAULT_REQUESTS: dict[str, dict[str, Any]] = {
    "tiny": dict(height=64, width=64, num_frames=9, num_inference_steps=2, guidance_scale=5.0),
    "small": dict(height=256, width=256, num_frames=17, num_inference_steps=8, guidance_scale=5.0),
}

# Wan2.1 renders at 16 frames per second.
DEFAULT_FPS = 16.0

SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2, as in T5/UMT5

# model_index.json entries. The published Wan2.1 checkpoints name T5TokenizerFast, but in transformers 5
# T5Tokenizer (= T5TokenizerFast) rebuilds its normaliser and pre-tokeniser on load and so would drop
# ours; the generic tokenizers-backed class, which AutoTokenizer resolves for what we save, loads
# tokenizer.json exactly as written.
_COMPONENT_CLASSES: dict[str, tuple[str, str]] = {
    "scheduler": ("diffusers", "UniPCMultistepScheduler"),
    "text_encoder": ("transformers", "UMT5EncoderModel"),
    "tokenizer": ("transformers", "TokenizersBackend"),
    "transformer": ("diffusers", "WanTransformer3DModel"),
    "vae": ("diffusers", "AutoencoderKLWan"),
}


def init_model(
    family: str,
    preset: str,
    out_dir: str | Path,
    seed: int = 0,
    shard_size: int | None = None,
) -> Path:
    """Write a random-weight `family` checkpoint of size `preset` to `out_dir` and return its path.

    The same seed gives byte-identical weight files. `shard_size` (bytes) splits large weight files
    into shards, as big real checkpoints are.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; allowed: {', '.join(FAMILIES)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; allowed: {', '.join(PRESETS)}")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_kwargs: dict[str, Any] = {} if shard_size is None else {"max_shard_size": shard_size}
    logger.info("writing %s/%s checkpoint (seed %d) to %s", family, preset, seed, out)

    # Seeding stays local to this call; weights are created (and so saved) in float32.
    with torch.random.fork_rng(devices=[]), _default_dtype(torch.float32):
        tokenizer = build_tokenizer(**TOKENIZER_CONFIGS[preset])
        tokenizer.save_pretrained(out / "tokenizer")
        logger.info("tokenizer: %d tokens", len(tokenizer))

        torch.manual_seed(seed)
        text_encoder = build_text_encoder(preset, vocab_size=len(tokenizer))
        text_encoder.save_pretrained(out / "text_encoder", **save_kwargs)
        logger.info("text_encoder: %.2fM parameters", _millions(text_encoder))
        del text_encoder

        torch.manual_seed(seed)
        transformer = build_transformer(preset)
        transformer.save_pretrained(out / "transformer", **save_kwargs)
        logger.info("transformer: %.2fM parameters", _millions(transformer))
        del transformer

        torch.manual_seed(seed)
        vae = build_vae(preset, seed)
        vae.save_pretrained(out / "vae", **save_kwargs)
        logger.info("vae: %.2fM parameters", _millions(vae))
        del vae

        build_scheduler().save_pretrained(out / "scheduler")

    _write_model_index(out)
    _write_default_request(out, preset)
    logger.info("checkpoint written to %s", out)
    return out


def build_transformer(preset: str) -> torch.nn.Module:
    """The preset's WanTransformer3DModel with freshly initialised weights."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(**TRANSFORMER_CONFIGS[preset]).eval()


def build_vae(preset: str, seed: int) -> torch.nn.Module:
    """The preset's AutoencoderKLWan, with latent statistics drawn from `seed`."""
    from diffusers import AutoencoderKLWan

    config = dict(VAE_CONFIGS[preset])
    z_dim = config["z_dim"]
    stats = torch.Generator().manual_seed(seed)
    mean = torch.randn(z_dim, generator=stats, device="cpu") * 0.5
    std = 1.0 + 2.0 * torch.rand(z_dim, generator=stats, device="cpu")  # in [1, 3), like the real model's
    config["latents_mean"] = [round(v, 4) for v in mean.tolist()]
    config["latents_std"] = [round(v, 4) for v in std.tolist()]
    return AutoencoderKLWan(**config).eval()


def build_text_encoder(preset: str, vocab_size: int) -> torch.nn.Module:
    """The preset's UMT5EncoderModel, with one embedding row per tokenizer token."""
    from transformers import UMT5Config, UMT5EncoderModel

    config = UMT5Config(vocab_size=vocab_size, **TEXT_ENCODER_CONFIGS[preset])
    return UMT5EncoderModel(config).eval()


def build_scheduler() -> Any:
    """The flow-matching UniPC scheduler Wan2.1 ships with."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(**SCHEDULER_CONFIG)


def build_tokenizer(vocab_size: int, corpus_sentences: int, corpus_names: int) -> Any:
    """A T5-style (sentencepiece Unigram) tokenizer trained on the built-in corpus.

    Like UMT5's: <pad>=0, </s>=1, <unk>=2; NFKC normalisation with runs of whitespace collapsed;
    Metaspace pre-tokenisation ("▁" marks a word start); "</s>" appended to every sequence.
    It depends only on its arguments, not on any seed: a preset always gets the same tokenizer.
    """
    from tokenizers import Tokenizer, models, trainers
    from transformers import PreTrainedTokenizerFast

    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        unk_token="<unk>",
        # Every printable ASCII character gets a piece, so plain English text never maps to <unk>.
        initial_alphabet=[c for c in string.printable if not c.isspace()],
        max_piece_length=16,
        show_progress=False,
    )
    trained = _with_t5_pipeline(Tokenizer(models.Unigram()))
    trained.train_from_iterator(training_corpus(corpus_sentences, corpus_names), trainer=trainer)
    vocab = _canonical_vocab(json.loads(trained.to_str())["model"]["vocab"])

    unk_id = SPECIAL_TOKENS.index("<unk>")
    tokenizer = _with_t5_pipeline(Tokenizer(models.Unigram(vocab, unk_id=unk_id, byte_fallback=False)))
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    # In transformers 5 PreTrainedTokenizerFast is TokenizersBackend, the name saved and resolved.
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=1_000_000,  # effectively unlimited, as UMT5's: the pipeline truncates itself
        padding_side="right",
    )


def _with_t5_pipeline(tokenizer: Any) -> Any:
    """Attach T5's normaliser, pre-tokeniser, decoder and "$A </s>" post-processor to `tokenizer`."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors

    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip()]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    eos_id = SPECIAL_TOKENS.index("</s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos_id)]
    )
    return tokenizer


def _canonical_vocab(vocab: list[list[Any]]) -> list[tuple[str, float]]:
    """The trained Unigram vocabulary in a run-independent order.

    The trainer gives characters that never won a segmentation a score just above the lowest one,
    0.0001 apart in hash-set order, which differs from run to run. Give them all the lowest score,
    round away summation noise, and break ties by the piece itself.
    """
    specials = [(str(piece), 0.0) for piece, _ in vocab[: len(SPECIAL_TOKENS)]]
    if [piece for piece, _ in specials] != list(SPECIAL_TOKENS):
        raise RuntimeError(f"special tokens came out as {specials}, expected {SPECIAL_TOKENS} first")
    learned = [(str(piece), float(score)) for piece, score in vocab[len(SPECIAL_TOKENS) :]]
    lowest = min(score for _, score in learned)
    band = lowest + 1e-4 * (sum(len(piece) == 1 for piece, _ in learned) + 1)
    learned = [(piece, lowest if len(piece) == 1 and score <= band else score) for piece, score in learned]
    learned = sorted(((piece, round(score, 6)) for piece, score in learned), key=lambda ps: (-ps[1], ps[0]))
    return specials + learned


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _write_default_request(out: Path, preset: str) -> None:
    """Records the request the preset is sized for; servers use it for fields a request leaves unset.

    Real checkpoints have no such file and get Wan2.1's defaults (480x832, 81 frames, 50 steps).
    """
    default_request = {**DEFAULT_REQUESTS[preset], "fps": DEFAULT_FPS}
    (out / DEFAULTS_FILE).write_text(json.dumps({"default_request": default_request}, indent=2) + "\n")


def _write_model_index(out: Path) -> None:
    """model_index.json as in the published Wan2.1 diffusers checkpoints."""
    import diffusers

    index: dict[str, Any] = {"_class_name": "WanPipeline", "_diffusers_version": diffusers.__version__}
    index.update({name: list(cls) for name, cls in _COMPONENT_CLASSES.items()})
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _millions(model: torch.nn.Module) -> float:
    return sum(p.numel() for p in model.parameters()) / 1e6


# ---------------------------------------------------------------------------------------------
# Tokenizer training corpus: a few paragraphs of varied prose plus video-prompt-like sentences
# generated deterministically from word lists, enough distinct words and sub-words for an
# 8000-piece vocabulary.

def _words(text: str) -> list[str]:
    return text.split()


def _phrases(text: str) -> list[str]:
    return [phrase.strip() for phrase in text.split("|")]


_PROSE = """
A red fox trots across a snowy field at dawn, its breath rising in small white clouds. The camera
follows from a low angle, then slowly pulls back to reveal a frozen lake and a line of dark pine
trees. In the distance a church bell rings twice; crows lift from the branches and scatter.

The city never sleeps. Neon signs flicker above wet streets, taxis splash through puddles, and a
street vendor fans the smoke rising from his grill. A woman in a yellow raincoat waits under an
umbrella while trams glide past, their windows glowing with warm light. It is 11:45 p.m. on a
Thursday in November, and the forecast promises 3 to 5 centimetres of rain before midnight.

Under the ocean surface, sunlight breaks into shifting ribbons. A sea turtle drifts over a coral
reef where clownfish dart between anemones; a shoal of silver sardines turns all at once, like a
single living mirror. Bubbles climb toward the light, wobbling as they go.

Close-up of an old craftsman's hands shaping wet clay on a potter's wheel. The bowl grows taller
and thinner with every turn. Dust hangs in the afternoon light; on the shelves behind him stand
dozens of jars, vases and cups, glazed blue, green, ochre and deep crimson.

An astronaut floats inside the space station, tapping a tablet as Earth rolls past the window:
deserts, oceans, the thin blue edge of the atmosphere, and then the sudden darkness of night with
cities glittering like embers. "Houston, we're ready for the next experiment," she says.

Time-lapse: clouds race over a mountain valley, shadows sweep across green meadows, and a river
winds toward the horizon. Wildflowers open and close; the sun sets behind jagged peaks, stars wheel
overhead, and the Milky Way slowly rises above a quiet campsite with one glowing orange tent.

Professional product shot of a glass perfume bottle on black marble, soft rim lighting, shallow
depth of field, 4K, 60 fps, highly detailed, photorealistic. Negative: blurry, low quality,
overexposed, watermark, text, distorted hands, extra fingers, jpeg artifacts, static, worst quality.

Children chase soap bubbles through a sunny park while a golden retriever bounds after them,
barking happily. An elderly couple shares a bench and a thermos of tea; pigeons gather at their feet
hoping for crumbs. Somewhere a violinist plays a slow waltz, and the leaves begin to fall.
"""

_SUBJECTS = _words("""
fox wolf bear deer rabbit squirrel owl eagle hawk sparrow pigeon swan duck goose heron flamingo
penguin dolphin whale shark octopus jellyfish turtle crab lobster salmon butterfly dragonfly bee
ant spider horse pony donkey cow sheep goat pig chicken rooster cat kitten dog puppy lion tiger
leopard cheetah panther elephant giraffe zebra hippo rhino gorilla monkey chimpanzee panda koala
kangaroo camel llama alpaca otter beaver raccoon hedgehog badger lizard chameleon snake crocodile
frog toad dragon unicorn phoenix robot android astronaut pilot sailor fisherman farmer gardener
baker chef waiter painter sculptor dancer ballerina drummer guitarist pianist violinist singer
child toddler teenager grandmother grandfather woman man girl boy knight samurai ninja wizard witch
pirate cowboy detective soldier firefighter doctor nurse scientist engineer student teacher monk
skateboarder surfer skier snowboarder cyclist runner swimmer climber diver juggler magician clown
train tram bus taxi truck tractor motorcycle bicycle scooter sailboat yacht canoe kayak submarine
airplane helicopter balloon rocket spaceship satellite drone lighthouse windmill castle cathedral
""")

_ADJECTIVES = _words("""
red orange yellow green blue purple violet pink crimson scarlet golden silver bronze copper white
black grey brown turquoise emerald sapphire amber ivory pale dark bright vivid glowing shimmering
sparkling glittering gleaming dusty rusty muddy snowy icy frozen foggy misty rainy stormy windy
sunny cloudy humid tropical arctic ancient old young tiny small little huge giant enormous massive
tall short thin fat slender fluffy furry feathery scaly wet dry soft hard smooth rough sharp blunt
wooden metallic glass crystal plastic paper velvet silk leather woolen cotton marble stone brick
happy sad angry calm curious playful sleepy lazy energetic graceful clumsy elegant mysterious
magical futuristic retro vintage modern medieval baroque gothic minimalist surreal whimsical
cinematic dramatic moody serene peaceful chaotic busy quiet lonely crowded abandoned haunted
""")

_VERBS = _words("""
runs walks jumps leaps hops climbs crawls swims dives flies soars glides floats drifts spins
twirls dances sings plays paints draws writes reads sleeps dreams wakes eats drinks cooks bakes
laughs smiles cries shouts whispers waves nods bows kneels sits stands rests waits watches looks
searches explores wanders travels rides drives sails rows paddles surfs skates skis races chases
hunts catches throws kicks pushes pulls lifts carries holds drops builds repairs opens closes
""")

_PLACES = _words("""
forest jungle desert savanna meadow prairie field farm orchard vineyard garden park playground
beach shore coast cliff cave canyon valley mountain volcano glacier island lagoon lake pond river
stream waterfall ocean sea reef harbor port dock pier bridge tunnel road highway street alley
market bazaar square plaza fountain temple shrine palace tower skyscraper rooftop balcony attic
basement kitchen bedroom library classroom laboratory factory warehouse workshop studio theater
stadium arena museum gallery station airport subway village town city metropolis spaceport moon
planet nebula galaxy asteroid orbit wasteland swamp marsh tundra steppe oasis dune hillside
""")

_TIMES = _phrases("""
at dawn|at sunrise|in the morning|at noon|in the afternoon|at sunset|at dusk|at twilight|at night|
at midnight|during a thunderstorm|in heavy rain|in light snow|in thick fog|under a full moon|
under the stars|in early spring|in late summer|in autumn|in the depths of winter|during a festival|
on a quiet Sunday|in the year 2077|in the nineteenth century|during the golden hour
""")

_STYLES = _phrases("""
cinematic lighting|soft natural light|dramatic shadows|volumetric fog|lens flare|shallow depth of field|
wide angle|close-up shot|aerial view|drone footage|tracking shot|slow motion|time-lapse|handheld camera|
the camera pans left|the camera pans right|the camera tilts up|the camera zooms in|the camera orbits|
photorealistic|hyperrealistic|oil painting|watercolor|pencil sketch|anime style|pixel art|claymation|
stop motion|film grain|35mm film|black and white|high contrast|pastel colors|neon colors|
ultra detailed|8K resolution|HDR|studio lighting|documentary style|dreamlike atmosphere
""")

_PREPOSITIONS = _words("across through over under along beside behind inside around toward near into past above")


# Syllable parts for made-up names of people and places ("Brisca", "Talvoren").
# An empty onset or coda lets a syllable start with its vowel or end on it.
_ONSETS = _words("b bl br c ch cl cr d dr f fl fr g gl gr h j k l m n p pl pr qu r s sc sh sk sl sn st sw t th tr")
_ONSETS += ["v", "w", "z", ""]
_NUCLEI = _words("a e i o u y ai au ea ee ei ie oa oo ou")
_CODAS = _words("n r l s m th nd rk st x ck ll ng rn ld nt sh") + [""] * 6


def _made_up_names(rng: random.Random, count: int) -> list[str]:
    """`count` distinct pronounceable names, two or three syllables each."""
    names: set[str] = set()
    while len(names) < count:
        syllables = rng.choice((2, 2, 3))
        name = ""
        for i in range(syllables):
            name += rng.choice(_ONSETS) + rng.choice(_NUCLEI)
            if i == syllables - 1 or rng.random() < 0.3:
                name += rng.choice(_CODAS)
        names.add(name.capitalize())
    return sorted(names)


def training_corpus(num_sentences: int, num_names: int) -> list[str]:
    """The tokenizer's training text: the prose above plus `num_sentences` generated prompts."""
    rng = random.Random(20240229)
    names = _made_up_names(rng, num_names)
    lines = [line.strip() for line in _PROSE.strip().splitlines() if line.strip()]
    for _ in range(num_sentences):
        subject = f"{rng.choice(_ADJECTIVES)} {rng.choice(_SUBJECTS)}"
        if rng.random() < 0.5:
            subject += f" named {rng.choice(names)}"
        place = f"{rng.choice(_ADJECTIVES)} {rng.choice(_PLACES)} of {rng.choice(names)}"
        article = rng.choice(["A", "The", "One", "A single"])
        if article == "A" and subject[0] in "aeiou":
            article = "An"
        sentence = f"{article} {subject} {rng.choice(_VERBS)} "
        sentence += f"{rng.choice(_PREPOSITIONS)} the {place} {rng.choice(_TIMES)}"
        sentence += f", {rng.choice(_STYLES)}, {rng.choice(_STYLES)}"
        if rng.random() < 0.3:
            sentence += f", {rng.randint(2, 120)} frames at {rng.choice([8, 16, 24, 30, 60])} fps"
        lines.append(sentence + rng.choice([".", ".", "!", "?", ";"]))
    return lines
