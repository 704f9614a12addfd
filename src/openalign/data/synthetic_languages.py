"""The synthetic world's captions in German, French and Czech, for the multilingual model (ALIGN Sec. 7).

Each language has its own lexicon (colours, sizes, shapes, positions, relations, backgrounds, numbers)
and the grammar a caption of a scene needs: German adjective endings by gender and case (nominative
after "ein", dative after a relation), French agreement with colour after the noun and size before it
and elision ("à gauche d'une étoile"), Czech adjective endings by gender and case (genitive after
"vlevo od", instrumental after "nad"/"pod") and "dva"/"dvě" by gender. One wording per concept:
what differs between languages is the words and their order, which is what the shared vocabulary and
the text tower must absorb. Czech diacritics (č, ř, ž, ě, ů, ý) exercise the tokenizer's normalisation.

English captions are written by ``synthetic.caption_scene`` itself, so the English world is unchanged.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

LANGUAGES = ("en", "de", "fr", "cs")  # Multi30K's four


class _Object(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def colour(self) -> str: ...
    @property
    def size(self) -> str: ...


class _Scene(Protocol):
    @property
    def layout(self) -> str: ...
    @property
    def background(self) -> str: ...
    @property
    def position(self) -> str: ...
    @property
    def relation(self) -> str: ...
    @property
    def objects(self) -> Sequence[_Object]: ...


# --------------------------------------------------------------------------------------------------
# German: gender m/f/n; nominative after "ein(e)", dative after a relation, strong plural without article.


@dataclass(frozen=True)
class _DeNoun:
    gender: str
    singular: str
    plural: str


_DE_NOUNS = {
    "circle": _DeNoun("m", "Kreis", "Kreise"),
    "square": _DeNoun("n", "Quadrat", "Quadrate"),
    "triangle": _DeNoun("n", "Dreieck", "Dreiecke"),
    "star": _DeNoun("m", "Stern", "Sterne"),
    "cross": _DeNoun("n", "Kreuz", "Kreuze"),
    "ring": _DeNoun("m", "Ring", "Ringe"),
    "diamond": _DeNoun("f", "Raute", "Rauten"),
}
_DE_COLOURS = {
    "red": "rot",
    "orange": "orangefarben",
    "yellow": "gelb",
    "green": "grün",
    "blue": "blau",
    "purple": "violett",
    "white": "weiß",
    "black": "schwarz",
}
_DE_SIZES = {"small": "klein", "large": "groß"}
_DE_ARTICLE = {"nom": {"m": "ein", "f": "eine", "n": "ein"}, "dat": {"m": "einem", "f": "einer", "n": "einem"}}
_DE_ENDING = {"nom": {"m": "er", "f": "e", "n": "es"}, "dat": {"m": "en", "f": "en", "n": "en"}}
_DE_PLURAL_ENDING = "e"  # strong declension: no article before the number
_DE_POSITIONS = {"left": "links", "right": "rechts", "top": "oben", "bottom": "unten", "centre": "in der Mitte"}
_DE_RELATIONS = {"left of": "links von", "right of": "rechts von", "above": "über", "below": "unter"}  # + dative
_DE_BACKGROUNDS = {
    "grass": "auf Gras",
    "sand": "auf Sand",
    "water": "auf Wasser",
    "stripes": "auf Streifen",
    "dots": "auf Punkten",
    "bricks": "auf Ziegeln",
}
_DE_COUNTS = {2: "zwei", 3: "drei"}


def _de_np(obj: _Object, case: str, with_size: bool) -> str:
    noun = _DE_NOUNS[obj.kind]
    ending = _DE_ENDING[case][noun.gender]
    adjectives = ([_DE_SIZES[obj.size]] if with_size else []) + [_DE_COLOURS[obj.colour]]
    return " ".join([_DE_ARTICLE[case][noun.gender], *(a + ending for a in adjectives), noun.singular])


def _de_plural(obj: _Object, count: int, with_size: bool) -> str:
    adjectives = ([_DE_SIZES[obj.size]] if with_size else []) + [_DE_COLOURS[obj.colour]]
    return " ".join([_DE_COUNTS[count], *(a + _DE_PLURAL_ENDING for a in adjectives), _DE_NOUNS[obj.kind].plural])


# --------------------------------------------------------------------------------------------------
# French: size before the noun, colour after it, both agreeing in gender and number; "de" elides.


@dataclass(frozen=True)
class _FrNoun:
    gender: str
    singular: str
    plural: str


_FR_NOUNS = {
    "circle": _FrNoun("m", "cercle", "cercles"),
    "square": _FrNoun("m", "carré", "carrés"),
    "triangle": _FrNoun("m", "triangle", "triangles"),
    "star": _FrNoun("f", "étoile", "étoiles"),
    "cross": _FrNoun("f", "croix", "croix"),
    "ring": _FrNoun("m", "anneau", "anneaux"),
    "diamond": _FrNoun("m", "losange", "losanges"),
}
# (masculine, feminine, masculine plural, feminine plural)
_FR_COLOURS = {
    "red": ("rouge", "rouge", "rouges", "rouges"),
    "orange": ("orange", "orange", "orange", "orange"),
    "yellow": ("jaune", "jaune", "jaunes", "jaunes"),
    "green": ("vert", "verte", "verts", "vertes"),
    "blue": ("bleu", "bleue", "bleus", "bleues"),
    "purple": ("violet", "violette", "violets", "violettes"),
    "white": ("blanc", "blanche", "blancs", "blanches"),
    "black": ("noir", "noire", "noirs", "noires"),
}
_FR_SIZES = {
    "small": ("petit", "petite", "petits", "petites"),
    "large": ("grand", "grande", "grands", "grandes"),
}
_FR_POSITIONS = {"left": "à gauche", "right": "à droite", "top": "en haut", "bottom": "en bas", "centre": "au centre"}
_FR_RELATIONS = {"left of": "à gauche d'", "right of": "à droite d'", "above": "au-dessus d'", "below": "sous "}
_FR_BACKGROUNDS = {
    "grass": "sur l'herbe",
    "sand": "sur le sable",
    "water": "sur l'eau",
    "stripes": "sur des rayures",
    "dots": "sur des pois",
    "bricks": "sur des briques",
}
_FR_COUNTS = {2: "deux", 3: "trois"}


def _fr_form(forms: tuple[str, str, str, str], gender: str, plural: bool) -> str:
    return forms[(2 if plural else 0) + (gender == "f")]


def _fr_np(obj: _Object, with_size: bool, count: int = 1) -> str:
    noun = _FR_NOUNS[obj.kind]
    plural = count > 1
    words = [_FR_COUNTS[count] if plural else ("une" if noun.gender == "f" else "un")]
    if with_size:
        words.append(_fr_form(_FR_SIZES[obj.size], noun.gender, plural))
    words += [noun.plural if plural else noun.singular, _fr_form(_FR_COLOURS[obj.colour], noun.gender, plural)]
    return " ".join(words)


# --------------------------------------------------------------------------------------------------
# Czech: no articles; hard adjectives (stem + ending by gender and case), genitive after "vlevo/vpravo od",
# instrumental after "nad"/"pod"; masculine nouns here are inanimate, so their plural adjective ends in -é.


@dataclass(frozen=True)
class _CsNoun:
    gender: str
    nom: str
    plural: str
    gen: str
    ins: str


_CS_NOUNS = {
    "circle": _CsNoun("m", "kruh", "kruhy", "kruhu", "kruhem"),
    "square": _CsNoun("m", "čtverec", "čtverce", "čtverce", "čtvercem"),
    "triangle": _CsNoun("m", "trojúhelník", "trojúhelníky", "trojúhelníku", "trojúhelníkem"),
    "star": _CsNoun("f", "hvězda", "hvězdy", "hvězdy", "hvězdou"),
    "cross": _CsNoun("m", "kříž", "kříže", "kříže", "křížem"),
    "ring": _CsNoun("m", "prstenec", "prstence", "prstence", "prstencem"),
    "diamond": _CsNoun("m", "kosočtverec", "kosočtverce", "kosočtverce", "kosočtvercem"),
}
_CS_COLOURS = {
    "red": "červen",
    "orange": "oranžov",
    "yellow": "žlut",
    "green": "zelen",
    "blue": "modr",
    "purple": "fialov",
    "white": "bíl",
    "black": "čern",
}
_CS_SIZES = {"small": "mal", "large": "velk"}
_CS_ENDING = {
    "nom": {"m": "ý", "f": "á"},
    "plural": {"m": "é", "f": "é"},
    "gen": {"m": "ého", "f": "é"},
    "ins": {"m": "ým", "f": "ou"},
}
_CS_POSITIONS = {"left": "vlevo", "right": "vpravo", "top": "nahoře", "bottom": "dole", "centre": "uprostřed"}
_CS_RELATIONS = {"left of": ("vlevo od", "gen"), "right of": ("vpravo od", "gen"), "above": ("nad", "ins"),
                 "below": ("pod", "ins")}  # fmt: skip
_CS_BACKGROUNDS = {
    "grass": "na trávě",
    "sand": "na písku",
    "water": "na vodě",
    "stripes": "na pruzích",
    "dots": "na puntících",
    "bricks": "na cihlách",
}
_CS_COUNTS = {(2, "m"): "dva", (2, "f"): "dvě", (3, "m"): "tři", (3, "f"): "tři"}


def _cs_np(obj: _Object, case: str, with_size: bool) -> str:
    noun = _CS_NOUNS[obj.kind]
    ending = _CS_ENDING[case][noun.gender]
    adjectives = ([_CS_SIZES[obj.size]] if with_size else []) + [_CS_COLOURS[obj.colour]]
    form = {"nom": noun.nom, "plural": noun.plural, "gen": noun.gen, "ins": noun.ins}[case]
    return " ".join([*(a + ending for a in adjectives), form])


# --------------------------------------------------------------------------------------------------


def caption(scene: _Scene, r: random.Random, language: str) -> str:
    """An accurate caption of ``scene`` in ``language`` (de, fr or cs), naming what an English one names."""
    if language not in ("de", "fr", "cs"):
        raise ValueError(f"no synthetic captions in {language!r}; languages: {', '.join(LANGUAGES)}")
    if scene.layout == "single":
        obj = scene.objects[0]
        with_size = r.random() < 0.8
        if language == "de":
            np_, pos, bg = _de_np(obj, "nom", with_size), _DE_POSITIONS, _DE_BACKGROUNDS
        elif language == "fr":
            np_, pos, bg = _fr_np(obj, with_size), _FR_POSITIONS, _FR_BACKGROUNDS
        else:
            np_, pos, bg = _cs_np(obj, "nom", with_size), _CS_POSITIONS, _CS_BACKGROUNDS
        where, ground = pos[scene.position], bg[scene.background]
        return f"{np_} {where} {ground}" if r.random() < 0.5 else f"{np_} {ground} {where}"
    if scene.layout == "count":
        obj, count = scene.objects[0], len(scene.objects)
        with_size = r.random() < 0.6
        if language == "de":
            return f"{_de_plural(obj, count, with_size)} {_DE_BACKGROUNDS[scene.background]}"
        if language == "fr":
            return f"{_fr_np(obj, with_size, count)} {_FR_BACKGROUNDS[scene.background]}"
        number = _CS_COUNTS[(count, _CS_NOUNS[obj.kind].gender)]
        return f"{number} {_cs_np(obj, 'plural', with_size)} {_CS_BACKGROUNDS[scene.background]}"
    a, b = scene.objects
    size_a, size_b = r.random() < 0.7, r.random() < 0.7
    if language == "de":
        rel = _DE_RELATIONS[scene.relation]
        return f"{_de_np(a, 'nom', size_a)} {rel} {_de_np(b, 'dat', size_b)} {_DE_BACKGROUNDS[scene.background]}"
    if language == "fr":
        rel = _FR_RELATIONS[scene.relation]
        return f"{_fr_np(a, size_a)} {rel}{_fr_np(b, size_b)} {_FR_BACKGROUNDS[scene.background]}"
    rel, case = _CS_RELATIONS[scene.relation]
    return f"{_cs_np(a, 'nom', size_a)} {rel} {_cs_np(b, case, size_b)} {_CS_BACKGROUNDS[scene.background]}"


def lexicon(language: str) -> frozenset[str]:
    """Every word a caption in ``language`` (de, fr or cs) can use, as whitespace-separated tokens; French
    elisions count as one token with their apostrophe ("d'une")."""
    words: set[str] = set()
    if language == "de":
        words |= {n.singular for n in _DE_NOUNS.values()} | {n.plural for n in _DE_NOUNS.values()}
        stems = [*_DE_COLOURS.values(), *_DE_SIZES.values()]
        endings = {e for case in _DE_ENDING.values() for e in case.values()} | {_DE_PLURAL_ENDING}
        words |= {s + e for s in stems for e in endings}
        words |= {a for case in _DE_ARTICLE.values() for a in case.values()} | set(_DE_COUNTS.values())
        phrases = [*_DE_POSITIONS.values(), *_DE_RELATIONS.values(), *_DE_BACKGROUNDS.values()]
    elif language == "fr":
        words |= {n.singular for n in _FR_NOUNS.values()} | {n.plural for n in _FR_NOUNS.values()}
        words |= {f for forms in (*_FR_COLOURS.values(), *_FR_SIZES.values()) for f in forms}
        words |= {"un", "une", *_FR_COUNTS.values()}
        words |= {rel.split()[-1] + art for rel in _FR_RELATIONS.values() if rel.endswith("'") for art in ("un", "une")}
        phrases = [*_FR_POSITIONS.values(), *_FR_BACKGROUNDS.values()]
        phrases += [rel.rsplit(" ", 1)[0] if rel.endswith("'") else rel for rel in _FR_RELATIONS.values()]
    elif language == "cs":
        words |= {form for n in _CS_NOUNS.values() for form in (n.nom, n.plural, n.gen, n.ins)}
        stems = [*_CS_COLOURS.values(), *_CS_SIZES.values()]
        words |= {s + e for s in stems for case in _CS_ENDING.values() for e in case.values()}
        words |= set(_CS_COUNTS.values())
        phrases = [*_CS_POSITIONS.values(), *_CS_BACKGROUNDS.values(), *(rel for rel, _ in _CS_RELATIONS.values())]
    else:
        raise ValueError(f"no synthetic lexicon for {language!r}")
    for phrase in phrases:
        words |= set(phrase.split())
    return frozenset(words)
