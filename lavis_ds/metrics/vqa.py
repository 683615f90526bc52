"""VQAv2 accuracy, as the official evaluation computes it.

Ported from the VQA challenge's evaluation code (GT-Vision-Lab/VQA,
``PythonEvaluationTools/vqaEvaluation/vqaEval.py`` as of its Python 3 version,
``VQAEval.evaluate``; LAVIS ships the same file as ``lavis/common/vqa_tools/vqa_eval.py``),
behaviour for behaviour, including its quirks, so that scores match the
published ones:

- The generated answer: newlines and tabs become spaces, it is stripped, then
  :func:`process_punctuation` and :func:`process_digit_article` (lower case,
  number words to digits, articles dropped, missing apostrophes restored in
  contractions: ``dont`` -> ``don't``).
- The human answers get :func:`process_punctuation` only, and only when they are
  not all the same (the official annotation files are already normalised).
- Accuracy of a question: for each of the n human answers, leave it out and
  count how many of the other n-1 equal the generated answer; min(count / 3, 1);
  average over the n. With VQAv2's ten answers these are the 10-choose-9 subsets.
"""
from __future__ import annotations

import re

from lavis_ds.common import registry as reg
from lavis_ds.metrics.base import Metric

# Data of the official vqaEval.py, unchanged (its keys with capitals can never match after lower-casing;
# kept so that the table stays the official one).
CONTRACTIONS = {
    'aint': "ain't", 'arent': "aren't", 'cant': "can't", 'couldve': "could've", 'couldnt': "couldn't",
    "couldn'tve": "couldn't've", "couldnt've": "couldn't've", 'didnt': "didn't", 'doesnt': "doesn't",
    'dont': "don't", 'hadnt': "hadn't", "hadnt've": "hadn't've", "hadn'tve": "hadn't've", 'hasnt': "hasn't",
    'havent': "haven't", 'hed': "he'd", "hed've": "he'd've", "he'dve": "he'd've", 'hes': "he's", 'howd': "how'd",
    'howll': "how'll", 'hows': "how's", "Id've": "I'd've", "I'dve": "I'd've", 'Im': "I'm", 'Ive': "I've",
    'isnt': "isn't", 'itd': "it'd", "itd've": "it'd've", "it'dve": "it'd've", 'itll': "it'll", "let's": "let's",
    'maam': "ma'am", 'mightnt': "mightn't", "mightnt've": "mightn't've", "mightn'tve": "mightn't've",
    'mightve': "might've", 'mustnt': "mustn't", 'mustve': "must've", 'neednt': "needn't", 'notve': "not've",
    'oclock': "o'clock", 'oughtnt': "oughtn't", "ow's'at": "'ow's'at", "'ows'at": "'ow's'at",
    "'ow'sat": "'ow's'at", 'shant': "shan't", "shed've": "she'd've", "she'dve": "she'd've", "she's": "she's",
    'shouldve': "should've", 'shouldnt': "shouldn't", "shouldnt've": "shouldn't've", "shouldn'tve": "shouldn't've",
    "somebody'd": 'somebodyd', "somebodyd've": "somebody'd've", "somebody'dve": "somebody'd've",
    'somebodyll': "somebody'll", 'somebodys': "somebody's", 'someoned': "someone'd", "someoned've": "someone'd've",
    "someone'dve": "someone'd've", 'someonell': "someone'll", 'someones': "someone's", 'somethingd': "something'd",
    "somethingd've": "something'd've", "something'dve": "something'd've", 'somethingll': "something'll",
    'thats': "that's", 'thered': "there'd", "thered've": "there'd've", "there'dve": "there'd've",
    'therere': "there're", 'theres': "there's", 'theyd': "they'd", "theyd've": "they'd've",
    "they'dve": "they'd've", 'theyll': "they'll", 'theyre': "they're", 'theyve': "they've", 'twas': "'twas",
    'wasnt': "wasn't", "wed've": "we'd've", "we'dve": "we'd've", 'weve': "we've", 'werent': "weren't",
    'whatll': "what'll", 'whatre': "what're", 'whats': "what's", 'whatve': "what've", 'whens': "when's",
    'whered': "where'd", 'wheres': "where's", 'whereve': "where've", 'whod': "who'd", "whod've": "who'd've",
    "who'dve": "who'd've", 'wholl': "who'll", 'whos': "who's", 'whove': "who've", 'whyll': "why'll",
    'whyre': "why're", 'whys': "why's", 'wont': "won't", 'wouldve': "would've", 'wouldnt': "wouldn't",
    "wouldnt've": "wouldn't've", "wouldn'tve": "wouldn't've", 'yall': "y'all", "yall'll": "y'all'll",
    "y'allll": "y'all'll", "yall'd've": "y'all'd've", "y'alld've": "y'all'd've", "y'all'dve": "y'all'd've",
    'youd': "you'd", "youd've": "you'd've", "you'dve": "you'd've", 'youll': "you'll", 'youre': "you're",
    'youve': "you've",
}
NUMBER_WORDS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
                "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10"}
ARTICLES = ("a", "an", "the")
PUNCTUATION = (";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?", "!")
# Official patterns as written: "(?!<=\d)" is a look-ahead for the text "<=digit" (a typo for a look-behind),
# so a period is removed unless a digit follows it ("2.5" keeps it, "2." and "a.b" lose it).
_PERIOD = re.compile(r"(?!<=\d)(\.)(?!\d)")
_DIGIT_COMMA_DIGIT = re.compile(r"(\d)(\,)(\d)")
# The official call passes re.UNICODE as sub()'s third argument, which is `count`: at most 32 periods go.
_PERIOD_COUNT = int(re.UNICODE)


def process_punctuation(text: str) -> str:
    """The official ``processPunctuation``: each mark is deleted where it touches a space (or anywhere if the
    text has a digit-comma-digit), otherwise replaced by a space; then periods not before a digit go."""
    out = text
    glued = _DIGIT_COMMA_DIGIT.search(text) is not None
    for mark in PUNCTUATION:
        if mark + " " in text or " " + mark in text or glued:  # tested on the original text, as officially
            out = out.replace(mark, "")
        else:
            out = out.replace(mark, " ")
    return _PERIOD.sub("", out, _PERIOD_COUNT)


def process_digit_article(text: str) -> str:
    """The official ``processDigitArticle``: lower case, number words to digits, no articles, contractions."""
    words = [NUMBER_WORDS.get(w, w) for w in text.lower().split()]
    return " ".join(CONTRACTIONS.get(w, w) for w in words if w not in ARTICLES)


def normalise_answer(answer: str) -> str:
    """A generated answer as the official evaluation compares it."""
    answer = answer.replace("\n", " ").replace("\t", " ").strip()
    return process_digit_article(process_punctuation(answer))


def vqa_accuracy(answer: str, human_answers: list[str]) -> float:
    """One question's accuracy in [0, 1] (the official per-question value divided by 100, unrounded)."""
    answer = normalise_answer(answer)
    if len(set(human_answers)) > 1:
        human_answers = [process_punctuation(h) for h in human_answers]
    scores = []
    for left_out in range(len(human_answers)):
        matches = sum(h == answer for i, h in enumerate(human_answers) if i != left_out)
        scores.append(min(1.0, matches / 3))
    return sum(scores) / len(scores)


@reg.metrics.register("vqa_accuracy")
class VqaAccuracy(Metric):
    """Mean VQAv2 accuracy over the questions, in [0, 1] (the official "overall" is this x 100, rounded)."""

    scores = ("vqa_accuracy",)

    def compute(self, predictions: list[str], references: list[list[str]]) -> dict[str, float]:
        return {"vqa_accuracy": sum(map(vqa_accuracy, predictions, references)) / len(predictions)}
