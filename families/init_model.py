"""Write random-weight checkpoints in the real diffusers layout: the entry point and what every family shares.

No model hub is reachable where StageDiff is built and tested, so tests and benchmarks run on checkpoints made
here: the real classes with their real config keys, random weights saved as safetensors, and a tokenizer trained
locally with `tokenizers`. A directory written by `init_model` loads unchanged with the family's pipeline
(`diffusers.WanPipeline.from_pretrained(out_dir)`, ...), so every stage can be checked against diffusers.

`init_model` looks the family up in the registry and calls the writer the family names (`Family.writer`):

    write_checkpoint(family: Family, out: Path, preset: str, seed: int, save_kwargs: dict) -> None

The writer lives in the family's folder with its preset tables, writes every component, model_index.json and the
defaults file, and uses the helpers below. It runs with the global RNG forked (seeding stays local to the call)
and float32 as the default dtype. Every family writes the random presets in PRESETS; a family may declare presets
of its own (`Family.own_presets`, e.g. a published checkpoint's real configs with random weights), written in
whatever dtype and shard layout the preset stands for.

torch, diffusers and transformers are imported where they are used, so reading PRESETS (as the CLI does to build
its parser) stays cheap.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import json
import logging
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from families.base import DEFAULTS_FILE, Family
from families.registry import FAMILIES, FAMILY_NAMES

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# The random presets every family has, each with an entry in the family's preset tables: "tiny" runs a
# request in well under a second on one CPU thread (for tests), "small" is sized for benchmarks.
PRESETS = ("tiny", "small")
# Random-weight presets that some family declares for itself (`Family.own_presets`): written by its writer.
OWN_PRESETS = tuple(sorted({preset for family in FAMILIES.values() for preset in family.own_presets}))
# Presets with trained weights that some family ships (`Family.trained_presets`): copied, not written.
TRAINED_PRESETS = tuple(sorted({preset for family in FAMILIES.values() for preset in family.trained_presets}))
ALL_PRESETS = PRESETS + OWN_PRESETS + TRAINED_PRESETS
# A family's own preset of a published checkpoint's configs (random weights) ends so; it may take the configs from
# another checkpoint (`config_from`), which its writer is then given as `config_from=<directory>`.
CONFIG_PRESET_SUFFIX = "-config"


def init_model(
    family: str,
    preset: str,
    out_dir: str | Path,
    seed: int = 0,
    shard_size: int | None = None,
    config_from: Path | None = None,
) -> Path:
    """Write a random-weight `family` checkpoint of size `preset` to `out_dir` and return its path.

    The same seed gives byte-identical weight files. `shard_size` (bytes) splits large weight files
    into shards, as big real checkpoints are; a family's own preset (`Family.own_presets`) has the shard
    layout of the checkpoint it stands for unless `shard_size` is given. A trained preset of the family
    (`Family.trained_presets`) is copied to `out_dir` instead; seed and shard_size do not apply to it.
    `config_from` (a checkpoint directory, of which the configs are read) gives a config preset
    (`*-config`, e.g. "wan2.1-1.3b-config") the components' configs in place of the ones it has built in.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; allowed: {', '.join(FAMILY_NAMES)}")
    trained = FAMILIES[family].trained_presets
    if preset in trained:
        if seed != 0 or shard_size is not None:
            raise ValueError(
                f"preset {preset!r} is trained weights, copied as they are: seed and shard size do not apply"
            )
        return copy_trained_checkpoint(trained[preset], Path(out_dir))
    own = FAMILIES[family].own_presets
    if preset not in PRESETS and preset not in own:
        allowed = ", ".join((*PRESETS, *own, *trained))
        raise ValueError(f"unknown preset {preset!r} for {family}; allowed: {allowed}")
    if config_from is not None and not preset.endswith(CONFIG_PRESET_SUFFIX):
        config_presets = [name for name in own if name.endswith(CONFIG_PRESET_SUFFIX)]
        raise ValueError(
            f"--config-from: only a config preset takes the configs of another checkpoint; {family}'s: "
            f"{', '.join(config_presets) or 'none'}"
        )
    import torch

    write_checkpoint = FAMILIES[family].load("writer")
    configs: dict[str, Path] = {} if config_from is None else {"config_from": Path(config_from)}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_kwargs: dict[str, Any] = {} if shard_size is None else {"max_shard_size": shard_size}
    logger.info("writing %s/%s checkpoint (seed %d) to %s", family, preset, seed, out)
    with torch.random.fork_rng(devices=[]), _default_dtype(torch.float32):
        write_checkpoint(FAMILIES[family], out, preset, seed, save_kwargs, **configs)
    logger.info("checkpoint written to %s", out)
    return out


def trained_checkpoint_path(location: str) -> Path:
    """The directory of a trained preset, "package:directory" (Family.trained_presets), where it is installed."""
    package, _, directory = location.partition(":")
    path = Path(str(importlib.resources.files(package) / directory))
    if not (path / "model_index.json").is_file():
        raise FileNotFoundError(f"the trained checkpoint {location} is not installed at {path}")
    return path


def copy_trained_checkpoint(location: str, out: Path) -> Path:
    """Copies a trained preset's checkpoint to `out` (merged into it if it exists) and returns `out`."""
    source = trained_checkpoint_path(location)
    logger.info("copying the trained checkpoint %s to %s", source, out)
    shutil.copytree(source, out, dirs_exist_ok=True)
    return out


# ---------------------------------------------------------------------------------------------
# Saving helpers for the writers


def save_component(model: torch.nn.Module, out: Path, name: str, save_kwargs: dict[str, Any]) -> None:
    """Save a model component (safetensors weights and its config) to `out/name`."""
    model.save_pretrained(out / name, **save_kwargs)
    logger.info("%s: %.2fM parameters", name, sum(p.numel() for p in model.parameters()) / 1e6)


def save_tokenizer(tokenizer: Any, out: Path) -> None:
    tokenizer.save_pretrained(out / "tokenizer")
    logger.info("tokenizer: %d tokens", len(tokenizer))


def write_model_index(out: Path, family: Family, components: dict[str, tuple[str, str]], **entries: Any) -> None:
    """model_index.json: the pipeline class, its (library, class) per component and its config entries."""
    import diffusers

    index: dict[str, Any] = {"_class_name": family.class_name, "_diffusers_version": diffusers.__version__}
    index.update({name: list(cls) for name, cls in components.items()})
    index.update(entries)
    (out / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_default_request(out: Path, family: Family, request: dict[str, Any]) -> None:
    """Records the request the preset is sized for (and the family's fps); servers use it for fields a request
    leaves unset.

    Real checkpoints have no such file and get their family's reference defaults (services/checkpoint.py).
    """
    default_request = {**request, "fps": family.defaults.fps}
    (out / DEFAULTS_FILE).write_text(json.dumps({"default_request": default_request}, indent=2) + "\n")


def vae_with_latent_statistics(vae_class: type, config: dict[str, Any], seed: int) -> torch.nn.Module:
    """A VAE of `vae_class` from `config`, with latent statistics drawn from `seed` (latent_statistics)."""
    config = dict(config)
    config["latents_mean"], config["latents_std"] = latent_statistics(config["z_dim"], seed)
    return vae_class(**config).eval()


def latent_statistics(z_dim: int, seed: int) -> tuple[list[float], list[float]]:
    """Per-channel latent mean and std (positive, in [1, 3) like the real models') drawn from `seed`.

    A VAE's latents_mean / latents_std are drawn rather than fixed, so that the pipeline's de-normalisation
    of latents is exercised with non-trivial values.
    """
    import torch

    stats = torch.Generator().manual_seed(seed)
    mean = torch.randn(z_dim, generator=stats, device="cpu") * 0.5
    std = 1.0 + 2.0 * torch.rand(z_dim, generator=stats, device="cpu")
    return [round(v, 4) for v in mean.tolist()], [round(v, 4) for v in std.tolist()]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# ---------------------------------------------------------------------------------------------
# Tokenizer training corpus: a few paragraphs of varied prose plus video-prompt-like sentences
# generated deterministically from word lists, enough distinct words and sub-words for an
# 8000-piece vocabulary. Each family trains its own kind of tokenizer on it, sized by a table of
#   vocab_size       target number of pieces, special tokens included (a too-plain corpus ends short)
#   corpus_sentences generated prompt-like sentences to train on
#   corpus_names     distinct made-up proper names used in them (the main source of distinct sub-words)


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
