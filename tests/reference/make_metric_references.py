"""Print the reference numbers quoted in tests/test_metrics.py, from the reference implementations.

Needs `java` (pycocoevalcap's PTBTokenizer runs Stanford CoreNLP 3.4.1) and the official VQA
evaluation module, e.g. from the salesforce-lavis wheel (`pip download salesforce-lavis==1.0.2
--no-deps`, unzip, then pass the folder holding vqa_eval.py):

    python tests/reference/make_metric_references.py /path/to/lavis/common/vqa_tools
"""
import json
import sys
from pathlib import Path

from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from test_metrics import CAPTION_CASES, PTB_CASES, VQA_CASES  # noqa: E402

tokenizer = PTBTokenizer()
# COCOEvalCap.evaluate: tokenise references and results, then each scorer.
gts = tokenizer.tokenize({i: [{"caption": r} for r in refs] for i, (_, refs, _) in enumerate(CAPTION_CASES)})
res = tokenizer.tokenize({i: [{"caption": gen}] for i, (_, _, gen) in enumerate(CAPTION_CASES)})
bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
cider, _ = Cider().compute_score(gts, res)
print("CAPTION_REFERENCE", json.dumps({**{f"Bleu_{n + 1}": b for n, b in enumerate(bleu)}, "CIDEr": cider}))

lines = [line for line, _ in PTB_CASES]
java = tokenizer.tokenize({i: [{"caption": line}] for i, line in enumerate(lines)})
print("PTB_CASES", json.dumps([[line, java[i][0]] for i, line in enumerate(lines)], indent=1))

sys.path.insert(0, sys.argv[1])
from vqa_eval import VQAEval  # noqa: E402


class _Answers:  # the two attributes VQAEval reads from its VQA objects
    def __init__(self, qa):
        self.qa = qa

    def getQuesIds(self):
        return list(self.qa)


gt = {i: {"answers": [{"answer": a, "answer_id": k + 1} for k, a in enumerate(answers)],
          "question_type": "none", "answer_type": "other"} for i, (_, answers, _) in enumerate(VQA_CASES)}
pred = {i: {"answer": generated} for i, (generated, _, _) in enumerate(VQA_CASES)}
evaluation = VQAEval(_Answers(gt), _Answers(pred), n=2)
evaluation.evaluate()
print("\nVQA per question", [evaluation.evalQA[i] for i in range(len(VQA_CASES))])
print("VQA overall", evaluation.accuracy["overall"])
