"""Metric maths, in-process, against the reference implementations' own outputs.

The reference numbers below were produced once on a machine with Java by
``tests/reference/make_metric_references.py`` (kept beside this file): pycocoevalcap 1.2's
``PTBTokenizer`` (Stanford CoreNLP 3.4.1 through ``java``), ``Bleu(4)`` and ``Cider()`` exactly as
``COCOEvalCap.evaluate`` chains them, and the official VQA ``VQAEval`` (the copy LAVIS ships,
salesforce-lavis 1.0.2 ``lavis/common/vqa_tools/vqa_eval.py``, identical to GT-Vision-Lab/VQA's
Python 3 ``vqaEval.py``). CI has no Java; these constants are what the Java pipeline printed.
"""
from __future__ import annotations

import pytest

from lavis_ds.common.registry import metrics as metric_registry
from lavis_ds.common.registry import registry
from lavis_ds.metrics import build_metric, tokenize_caption
from lavis_ds.metrics.base import Metric
from lavis_ds.metrics.vqa import normalise_answer, process_punctuation, vqa_accuracy

# Real COCO Karpathy-test records (LAVIS coco_karpathy_test.json, as quoted in X1AOX1A/Demos
# InstructBLIP/blip2_instruct/README.md). The generated captions of 391895 and 386164 are BLIP-2's
# (quoted in the same README); the other four are written here to exercise commas, brackets and 's.
CAPTION_CASES = [
    ("val2014/COCO_val2014_000000391895.jpg",
     ["A man with a red helmet on a small moped on a dirt road. ",
      "Man riding a motor bike on a dirt road on the countryside.",
      "A man riding on the back of a motorcycle.",
      "A dirt path with a young person on a motor bike rests to the foreground of a verdant area with a "
      "bridge and a background of cloud-wreathed mountains. ",
      "A man in a red shirt and a red hat is on a motorcycle on a hill side."],
     "a man riding a motorcycle on a dirt road with mountains in the background"),
    ("val2014/COCO_val2014_000000060623.jpg",
     ["A young girl inhales with the intent of blowing out a candle. ",
      "A young girl is preparing to blow out her candle.",
      "A kid is to blow out the single candle in a bowl of birthday goodness. ",
      "Girl blowing out the candle on an ice-cream ",
      "A little girl is getting ready to blow out a candle on a small dessert."],
     "A little girl is blowing out a candle on her birthday cake."),
    ("val2014/COCO_val2014_000000483108.jpg",
     ["A man on a bicycle riding next to a train",
      "A person is riding a bicycle but there is a train in the background.",
      "a red and white train and a man riding a bicycle",
      "a guy that is riding his bike next to a train",
      "A man riding a bike past a train traveling along tracks."],
     "a man riding a bike next to a red and white train"),
    ("val2014/COCO_val2014_000000384213.jpg",
     ["A kitchen is shown with a variety of items on the counters.",
      "A kitchen has the windows open and plaid curtains.",
      "A kitchen with two windows and two metal sinks.",
      "An older kitchen with cluttered counter tops but empty sink.",
      "Glasses and bottles are placed near a kitchen sink."],
     "A kitchen with two sinks, a window (open) and plaid curtains."),
    ("val2014/COCO_val2014_000000386164.jpg",
     ["A wooden ball on top of a wooden stick.",
      "The table is full of wooden spoons and utensils.",
      "A wood table holding an assortment of wood cooking utensils.",
      "A selection of wooden kitchen tools on a counter.",
      "Wooden spoons are lined up on a table"],
     "a bunch of wooden spoons and forks laying on top of a table"),
    ("val2014/COCO_val2014_000000223648.jpg",
     ["Multiple wooden spoons are shown on a table top.",
      "A table surrounded by chairs and filled with cooking utensils.",
      "Wooden spoons laid out across a kitchen table.",
      "Wooden spoons and forks are all over a table.",
      "A table and chairs with wooden kitchen tools on top."],
     "Wooden spoons and forks on a kitchen table's top."),
]
# pycocoevalcap with the Java PTBTokenizer on CAPTION_CASES (make_metric_references.py printed these).
CAPTION_REFERENCE = {"Bleu_1": 0.8783783783665083, "Bleu_2": 0.7538981894865825, "Bleu_3": 0.6429994029885393,
                     "Bleu_4": 0.5077418130135434, "CIDEr": 1.6235938582820992}

# Each line as its own caption through pycocoevalcap's PTBTokenizer (Java) -> what it printed. Real
# COCO captions and constructed cases for every rule of lavis_ds/metrics/ptb_tokenizer.py.
PTB_CASES = [
    ('A man with a red helmet on a small moped on a dirt road. ',
     'a man with a red helmet on a small moped on a dirt road'),
    ("A man's dog can't swim; he cannot, won't or didn't.",
     "a man 's dog ca n't swim he can not wo n't or did n't"),
    ('The "big" cat (left) [right] {curly} is here...',
     'the big cat -lrb- left -rrb- -lsb- right -rsb- -lcb- curly -rcb- is here'),
    ('A cloud-wreathed mountain -- and a T-shirt - really!?',
     'a cloud-wreathed mountain and a t-shirt really !?'),
    ("He paid $5.50 for 50% of 1,000 apples at 3 p.m. on St. Patrick's day, e.g. today.",
     "he paid $ 5.50 for 50 % of 1,000 apples at 3 p.m. on st. patrick 's day e.g. today"),
    ("and/or a*b 'quoted' `tick` it's o'clock y'all gonna wanna",
     "and/or a * b quoted tick it 's o'clock y' all gon na wan na"),
    ('A dog. Another dog.A third dog.',
     'a dog another dog.a third dog'),
    ('Café “smart quotes” and ‘single’ … unicode—dash – en',
     'café smart quotes and single unicode dash en'),
    ('Man riding a motor bike on a dirt road on the countryside.',
     'man riding a motor bike on a dirt road on the countryside'),
    ('A dirt path with a young person on a motor bike rests to the foreground of a verdant area with a bridge and a background of cloud-wreathed mountains. ',
     'a dirt path with a young person on a motor bike rests to the foreground of a verdant area with a bridge and a background of cloud-wreathed mountains'),
    ('A young girl inhales with the intent of blowing out a candle. ',
     'a young girl inhales with the intent of blowing out a candle'),
    ('A kid is to blow out the single candle in a bowl of birthday goodness. ',
     'a kid is to blow out the single candle in a bowl of birthday goodness'),
    ('Girl blowing out the candle on an ice-cream ',
     'girl blowing out the candle on an ice-cream'),
    ('a red and white train and a man riding a bicycle',
     'a red and white train and a man riding a bicycle'),
    ('A kitchen is shown with a variety of items on the counters.',
     'a kitchen is shown with a variety of items on the counters'),
    ('Wooden spoons are lined up on a table',
     'wooden spoons are lined up on a table'),
    ('a collection of wooden spoons, forks, and other kitchen utensils are lined up on a table',
     'a collection of wooden spoons forks and other kitchen utensils are lined up on a table'),
    ("The dogs' bowls and the cat's toy aren't here; they're there, I'm sure we'll go, you'd say I've.",
     "the dogs bowls and the cat 's toy are n't here they 're there i 'm sure we 'll go you 'd say i 've"),
    ('"Hello," she said. \'Hi!\' he said... Really?!',
     'hello she said hi he said really ?!'),
    ("It's 5:30 in the U.S.A. now, vs. 4:30 in the U.K.",
     "it 's 5:30 in the u.s.a. now vs. 4:30 in the u.k."),
    ("What's that? Isn't it a 2-year-old boy's bike (blue)?",
     "what 's that is n't it a 2-year-old boy 's bike -lrb- blue -rrb-"),
    ('Two people -- a man and a woman -- are sitting on a bench - outside.',
     'two people a man and a woman are sitting on a bench outside'),
    ('A sign reads "STOP" in red & white; the price is $3.99 or 20% off.',
     'a sign reads stop in red & white the price is $ 3.99 or 20 % off'),
    ('a man in a t-shirt and/or jeans.   multiple   spaces\ttab',
     'a man in a t-shirt and/or jeans multiple spaces tab'),
    ('It’s a dog’s life, isn’t it — yes… “quoted”',
     "it 's a dog 's life is n't it yes quoted"),
    ('Mrs. Jones and Dr. Who meet at Main St. at 10 a.m.',
     'mrs. jones and dr. who meet at main st. at 10 a.m.'),
    ('Mt. Fuji is in the background etc.',
     'mt. fuji is in the background etc.'),
    ('Number 10 sits on No. 5 street',
     'number 10 sits on no. 5 street'),
    ('a pizza with pepperoni,olives and cheese.',
     'a pizza with pepperoni olives and cheese'),
    ("the 1-5 score of the 90's and '90s rock'n'roll band",
     "the 1-5 score of the 90 's and '90s rock 'n' roll band"),
    ('a 3d tv on the 1st floor w/ a 10ft. pole',
     'a 3d tv on the 1st floor w / a 10ft pole'),
    ('he is 5\'9" tall, i.e. tall.',
     'he is 5 9 tall i.e. tall'),
    ('A plate of food.It has meat.',
     'a plate of food.it has meat'),
    ('There is a sign that says "No Parking."',
     'there is a sign that says no parking'),
    ('a man holding a frisbee ( white ) in a park .',
     'a man holding a frisbee -lrb- white -rrb- in a park'),
    ('two giraffes standing next to each other in a field .',
     'two giraffes standing next to each other in a field'),
    ('A cat laying on top of a laptop computer keyboard!',
     'a cat laying on top of a laptop computer keyboard'),
    ('a couple of people that are on some skis',
     'a couple of people that are on some skis'),
    ("An old-fashioned clock on a building's side at 12 o'clock.",
     "an old-fashioned clock on a building 's side at 12 o'clock"),
    ("The boy's mother's car isn't the girls' car.",
     "the boy 's mother 's car is n't the girls car"),
    ('Plan B. Plan A.',
     'plan b. plan a.'),
    ("a man's hand holding a hot-dog's bun.",
     "a man 's hand holding a hot-dog 's bun"),
    ('He said:"go"',
     'he said go'),
    ('A bowl of soup, a sandwich & a drink.',
     'a bowl of soup a sandwich & a drink'),
    ('Is this a bus?? Yes!!!',
     'is this a bus ?? yes !!!'),
    ("She can't and won't; we didn't, don't",
     "she ca n't and wo n't we did n't do n't"),
    ('A sign: "Welcome to N.Y.C."',
     'a sign welcome to n.y.c.'),
    ('some people ... waiting',
     'some people waiting'),
    ("A stop sign with graffiti on it that reads 'Stop War'",
     'a stop sign with graffiti on it that reads stop war'),
    ('A group of people stand around a table with a cake on it , one of them wearing a hat .',
     'a group of people stand around a table with a cake on it one of them wearing a hat'),
    ('a #2 pencil and a @ symbol',
     'a # 2 pencil and a @ symbol'),
    ('I like plan B.',
     'i like plan b.'),
    ('a dog with vitamin c. yes',
     'a dog with vitamin c. yes'),
    ('A. Smith is here',
     'a. smith is here'),
    ('vitamin C. Yes',
     'vitamin c. yes'),
    ('I.',
     'i'),
    ('The letter I.',
     'the letter i'),
    ('He got an A. Then a B.',
     'he got an a then a b.'),
    ('plan B. The x',
     'plan b the x'),
    ('plan B. Then x',
     'plan b then x'),
    ('plan B. He x',
     'plan b he x'),
    ('plan B. She x',
     'plan b she x'),
    ('plan B. It x',
     'plan b it x'),
    ('plan B. They x',
     'plan b they x'),
    ('plan B. We x',
     'plan b we x'),
    ('plan B. There x',
     'plan b there x'),
    ('plan B. This x',
     'plan b this x'),
    ('plan B. That x',
     'plan b that x'),
    ('plan B. A x',
     'plan b a x'),
    ('plan B. An x',
     'plan b an x'),
    ('plan B. In x',
     'plan b in x'),
    ('plan B. On x',
     'plan b. on x'),
    ('plan B. I x',
     'plan b. i x'),
    ('plan B. Yes x',
     'plan b. yes x'),
    ('plan B. Smith x',
     'plan b. smith x'),
    ('plan B. And x',
     'plan b. and x'),
    ('plan B. But x',
     'plan b but x'),
    ('plan B. Two x',
     'plan b. two x'),
    ('u.s. The x',
     'u.s. the x'),
    ('u.s. Smith x',
     'u.s. smith x'),
    ('St. The x',
     'st. the x'),
    ('at 3 p.m. The x',
     'at 3 p.m. the x'),
    ('a red b. the x',
     'a red b. the x'),
]

# VQA: the first two question's answers are real VQAv2 annotations (question 262148000 "Where is he
# looking?", val2014 image 262148; question 393714000 "what color are the"), the rest are made to hit
# each normalisation rule. Expected: accuracy x 100 worked out by hand (comment), and equal to what the
# official VQAEval printed as evalQA (per question) and accuracy["overall"] (63.33).
_WHERE = ["down", "down", "at table", "skateboard", "down", "table", "down", "down", "down", "down"]
_COLOUR = ["light blue"] + ["white"] * 9
VQA_CASES = [
    ("Down.", _WHERE, 100.0),          # "down": 7 of 10; any 9 hold >= 6 -> min(6/3, 1) = 1
    ("at the table", _WHERE, 30.0),    # article goes -> "at table": 1 of 10; 9 subsets hold it (1/3), one not
    ("skateboard", _WHERE, 30.0),      # same: (9 x 1/3 + 0) / 10
    ("White", _COLOUR, 100.0),
    ("light blue", _COLOUR, 30.0),
    ("Two", ["2", "2", "2", "two", "3", "3", "3", "3", "3", "3"], 90.0),  # "2" x3 (human "two" is not mapped):
                                                                           # (3 x 2/3 + 7 x 1) / 10
    ("dont know", ["don't know"] * 2 + ["no"] * 8, 60.0),   # -> "don't know": (2 x 1/3 + 8 x 2/3) / 10
    ("3,000", ["3000", "3000", "3,000"] + ["many"] * 7, 90.0),  # digit,digit: commas deleted on both sides
    ("A dog.", ["dog"] + ["cat"] * 9, 30.0),
    ("yes!", ["yes"] * 10, 100.0),
    ("t-shirt", ["t-shirt"] * 4 + ["shirt"] * 6, 100.0),   # "-" becomes a space on both sides
    ("no", ["yes"] * 10, 0.0),
]
VQA_OFFICIAL_OVERALL = 63.33


def test_caption_scores_equal_pycocoevalcap_with_the_java_tokenizer():
    _, references, generated = zip(*CAPTION_CASES)
    scores = build_metric("caption")(list(generated), list(references))
    assert scores == pytest.approx(CAPTION_REFERENCE, rel=1e-12)


@pytest.mark.parametrize("line, java", PTB_CASES)
def test_tokenisation_equals_the_java_ptb_tokenizer(line, java):
    assert tokenize_caption(line) == java


def test_bleu_and_cider_by_hand():
    caption = build_metric("caption")
    # 4 of 5 unigrams match, same length (no brevity penalty): BLEU-1 = 0.8; 2 of 4 bigrams: BLEU-2 = sqrt(0.8 x 0.5).
    one = caption(["a man riding a horse"], [["a man riding a bike"]])
    assert one["Bleu_1"] == pytest.approx(0.8, rel=1e-6)
    assert one["Bleu_2"] == pytest.approx((0.8 * 0.75) ** 0.5, rel=1e-6)  # bigrams: a-man, man-riding, riding-a match
    # CIDEr-D of a caption equal to its only reference, in a corpus whose two images share no n-gram:
    # every n-gram has idf log(2), cosine 1, no length penalty -> 10 x mean over n = 1..4 = 10.
    two = caption(["A red bus stops.", "two green birds fly"], [["a red bus stops"], ["Two green birds fly!"]])
    assert two["CIDEr"] == pytest.approx(10.0, rel=1e-9)
    # Three-word captions have no 4-gram: that n contributes 0, so 10 x 3/4.
    three = caption(["A red bus.", "two green birds"], [["a red bus"], ["Two green birds!"]])
    assert three["CIDEr"] == pytest.approx(7.5, rel=1e-9)
    assert two["Bleu_1"] == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("generated, answers, expected", VQA_CASES)
def test_vqa_accuracy_per_question_equals_the_official_evaluation(generated, answers, expected):
    assert round(100 * vqa_accuracy(generated, answers), 2) == expected


def test_vqa_accuracy_overall_equals_the_official_evaluation():
    generated, answers, _ = zip(*VQA_CASES)
    result = build_metric("vqa_accuracy")(list(generated), list(answers))
    assert round(100 * result["vqa_accuracy"], 2) == VQA_OFFICIAL_OVERALL


@pytest.mark.parametrize("text, expected", [
    ("Two dogs.", "2 dogs"), ("an apple", "apple"), ("dont", "don't"), ("2.5", "2.5"), ("yes.", "yes"),
    ("red, white", "red white"), ("1,000", "1000"), ("  the\tend\n", "end"), ("red/white", "red white"),
])
def test_official_answer_normalisation(text, expected):
    assert normalise_answer(text) == expected


def test_official_punctuation_quirks():
    assert process_punctuation("a ;b") == "a b"   # touching a space: deleted, not spaced
    assert process_punctuation("a;b") == "a b"    # inside a word: a space
    assert process_punctuation("e.g") == "eg"     # a period not before a digit always goes


def test_exact_match_counts_a_match_with_any_reference():
    em = build_metric("exact_match")
    assert em(["A red circle.", "a blue  square", "a star"], [["a red circle"], ["x", "A Blue Square"], ["a moon"]]) \
        == {"exact_match": pytest.approx(2 / 3)}


@pytest.mark.parametrize("name", list(metric_registry))
def test_every_registered_metric_scores_a_tiny_split(name):
    metric = build_metric(name)
    assert isinstance(metric, Metric) and isinstance(metric.higher_is_better, bool)
    scores = metric(["a red circle", "two"], [["a red circle", "a circle"], ["2", "two", "3"]])
    assert set(scores) == set(metric.scores) and all(isinstance(v, float) for v in scores.values())
    assert metric([], []) == {}


def test_metric_names_use_the_registry_with_the_lavis_spelling():
    assert registry.get_metric_class("caption") is metric_registry.get("caption")
    with pytest.raises(KeyError, match=r"Unknown metric 'captoin'.*Did you mean 'caption'.*exact_match"):
        build_metric("captoin")


@pytest.mark.parametrize("predictions, references, message", [
    (["a"], [], "1 prediction.*0 reference"),
    (["a"], [[]], "sample 0: references must be a non-empty list"),
    (["a"], ["a cat"], "sample 0: references must be a non-empty list"),
    ([None], [["a"]], "sample 0: the prediction must be a string"),
])
def test_bad_inputs_name_the_sample(predictions, references, message):
    with pytest.raises(ValueError, match=message):
        build_metric("exact_match")(predictions, references)
