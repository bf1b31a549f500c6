"""Object-detection reward: the boxes of a response against the ground-truth boxes (IoU and COCO mAP).

    detection_reward("<answer>[{'bbox_2d': [10, 10, 50, 50], 'label': 'cat'}]</answer>",
                     "<answer>[{'bbox_2d': [10, 10, 50, 50], 'label': 'cat'}]</answer>")   # 1.0

The scoring follows alibaba/ROLL's ``DetectionRewardWorker`` (itself after MiniMax's
One-RL-to-See-Them-All verifier); roll's own code:

- Boxes are the JSON list inside the first ``<answer>...</answer>`` (single quotes allowed, a list cut
  off after its last complete item is closed): items ``{"bbox_2d": [x1, y1, x2, y2], "label": str}``
  with x1 <= x2 and y1 <= y2; other items are dropped, and a repeated position counts once. Labels
  compare case-insensitively.
- ``det_verifier_normalized``: predicted coordinates are in pixels of the image the model saw
  (Qwen2.5-VL's absolute coordinates), ground truths in [0, 1000]; predictions are scaled by the
  row's image size (``context["image_sizes"][0]``, width and height after the processor's resize).
- IoU scores, for two greedy matchings (highest IoU first; per ground-truth box, same label first)
  at IoU thresholds 0.5, 0.55, ..., 0.95, 0.99: ``(1 - c) * mean IoU over ground-truth boxes
  + c * (1 - (miss rate + false-alarm rate) / 2)`` with ``c = det_reward_ratio["iou_completeness"]``
  (a pair of different labels matched highest-IoU-first adds IoU 0). ``iou_threshold``: one of the
  thresholds, or ``average`` (the mean over all 11).
- mAP, mAP50, mAP75 as COCO computes them for one image (101-point interpolated precision, IoU
  0.5:0.95, every detection scored 1.0 in the order given), over the ground truth's labels; predicted
  labels outside them are left out (as ROLL does).
- Each score is multiplied by ``0.6 ** |#predicted - #ground-truth boxes|``; the accuracy is the
  ``det_reward_ratio``-weighted mean of ``iou_max_iou_first``, ``iou_max_label_first``, ``map``,
  ``map50``, ``map75``.
- Format: 1.0 when the response has exactly one ``<answer>`` and one ``</answer>`` holding boxes.
  The reward is ``(accuracy * accuracy_ratio + format * format_ratio) / (accuracy_ratio + format_ratio)``.

Options come from the row (``context``: alibaba/ROLL's ``reward_model`` fields ``verifier_parm``,
``accuracy_ratio``, ``format_ratio``, put there by the data loader), else ``reward_kwargs``, else the
defaults below. Differences from ROLL: the threshold is the ``iou_threshold`` option (ROLL: the
``DET_IOU_THRESHOLD`` environment variable; its ``dynamic`` schedule is not offered); a missing
``det_reward_ratio`` weighs the five scores equally (ROLL: 0, a score of 0); the format check does not
require newlines around the tags; a ground truth without boxes is an error (ROLL: a warning, 0).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

IOU_THRESHOLDS = (0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.99)
COCO_IOUS = np.linspace(0.5, 0.95, 10)
COCO_RECALLS = np.linspace(0.0, 1.0, 101)
SIZE_PENALTY_BASE = 0.6
SCORE_KEYS = ("iou_max_iou_first", "iou_max_label_first", "map", "map50", "map75")
DEFAULT_RATIO = {**dict.fromkeys(SCORE_KEYS, 1.0), "iou_completeness": 0.0}
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

Box = tuple[tuple[float, float, float, float], str]


def answer_text(text: str) -> str:
    match = _ANSWER.search(text)
    return match.group(1).strip() if match else ""


def parse_boxes(text: str) -> list[Box]:
    """The valid, distinct boxes of a JSON list (see the module docstring); [] when there are none."""
    text = text.strip().replace("'", '"')
    if not text:
        return []
    items = _loads(text)
    if items is None and not text.endswith("]"):
        items = _loads(text.rsplit("},", 1)[0] + "}]")
    boxes: list[Box] = []
    seen = set()
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict) or not isinstance(item.get("label"), str):
            continue
        coords = item.get("bbox_2d")
        if not isinstance(coords, list) or len(coords) != 4:
            continue
        if not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in coords):
            continue
        x1, y1, x2, y2 = (float(c) for c in coords)
        if x1 > x2 or y1 > y2 or (x1, y1, x2, y2) in seen:
            continue
        seen.add((x1, y1, x2, y2))
        boxes.append(((x1, y1, x2, y2), item["label"].lower()))
    return boxes


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    if w <= 0 or h <= 0:
        return 0.0
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def match_iou_first(pred: list[Box], truth: list[Box], threshold: float) -> list[float]:
    """Greedy: the highest-IoU pair of unmatched boxes first while it reaches ``threshold``; each
    pair scores its IoU when the labels agree, else 0."""
    ious = {(i, j): iou(p[0], t[0]) for i, p in enumerate(pred) for j, t in enumerate(truth)}
    free_p, free_t, scores = set(range(len(pred))), set(range(len(truth))), []
    while free_p and free_t:
        i, j = max(((i, j) for i in sorted(free_p) for j in sorted(free_t)), key=lambda k: ious[k])
        if ious[i, j] < threshold:
            break
        scores.append(ious[i, j] if pred[i][1] == truth[j][1] else 0.0)
        free_p.discard(i)
        free_t.discard(j)
    return scores


def match_label_first(pred: list[Box], truth: list[Box], threshold: float) -> list[float]:
    """Per ground-truth box in order: the unmatched prediction of its label with the highest IoU
    (the first on ties), kept when it reaches ``threshold``."""
    used: set[int] = set()
    scores = []
    for box, label in truth:
        best, best_iou = None, -1.0
        for i, (p_box, p_label) in enumerate(pred):
            if i not in used and p_label == label and iou(p_box, box) > best_iou:
                best, best_iou = i, iou(p_box, box)
        if best is not None and best_iou >= threshold:
            used.add(best)
            scores.append(best_iou)
    return scores


def iou_score(matched: list[float], n_pred: int, n_truth: int, completeness: float) -> float:
    mean_iou = sum(matched) / n_truth
    miss = (n_truth - len(matched)) / n_truth
    false_alarm = (n_pred - len(matched)) / n_pred if n_pred else 0.0
    return (1.0 - completeness) * mean_iou + completeness * (1.0 - (miss + false_alarm) / 2.0)


def coco_ap(pred: list[Box], truth: list[Box]) -> dict[str, float]:
    """COCO bbox AP of one image, every detection scored 1.0 in order: mAP (IoU 0.5:0.95), AP50,
    AP75, averaged over the ground truth's labels."""
    per_label = []
    for label in sorted({lab for _, lab in truth}):
        gts = [b for b, lab in truth if lab == label]
        dts = [b for b, lab in pred if lab == label][:100]
        per_label.append([_ap_at(dts, gts, t) for t in COCO_IOUS])
    if not per_label or not any(lab in {t for _, t in truth} for _, lab in pred):
        return {"map": 0.0, "map50": 0.0, "map75": 0.0}
    ap = np.asarray(per_label)  # [labels, thresholds]
    return {"map": float(ap.mean()), "map50": float(ap[:, 0].mean()), "map75": float(ap[:, 5].mean())}


def _ap_at(dts: list[tuple], gts: list[tuple], threshold: float) -> float:
    taken = [False] * len(gts)
    hits = []
    for d in dts:
        best, best_iou = -1, min(threshold, 1 - 1e-10)
        for g, gt in enumerate(gts):
            if not taken[g] and iou(d, gt) >= best_iou:
                best, best_iou = g, iou(d, gt)
        if best >= 0:
            taken[best] = True
        hits.append(best >= 0)
    if not hits:
        return 0.0
    tp = np.cumsum(hits)
    fp = np.cumsum([not h for h in hits])
    recall = tp / len(gts)
    precision = tp / (tp + fp + np.spacing(1))
    precision = np.maximum.accumulate(precision[::-1])[::-1]  # the envelope COCO interpolates
    at = np.searchsorted(recall, COCO_RECALLS, side="left")
    return float(np.where(at < len(precision), precision[np.minimum(at, len(precision) - 1)], 0.0).mean())


def accuracy_score(
    pred: list[Box], truth: list[Box], ratio: dict[str, float], iou_threshold: str | float
) -> float:
    penalty = SIZE_PENALTY_BASE ** abs(len(pred) - len(truth))
    thresholds = IOU_THRESHOLDS if iou_threshold == "average" else (float(iou_threshold),)
    c = float(ratio["iou_completeness"])
    scores = {
        name: np.mean([iou_score(match(pred, truth, t), len(pred), len(truth), c) for t in thresholds])
        for name, match in (
            ("iou_max_iou_first", match_iou_first),
            ("iou_max_label_first", match_label_first),
        )
    }
    scores |= coco_ap(pred, truth)
    total = sum(float(ratio[k]) for k in SCORE_KEYS)
    if total <= 0:
        return 0.0
    return float(sum(float(ratio[k]) * scores[k] for k in SCORE_KEYS) / total * penalty)


def format_score(response: str) -> float:
    if response.count("<answer>") != 1 or response.count("</answer>") != 1:
        return 0.0
    return 1.0 if parse_boxes(answer_text(response)) else 0.0


def detection_reward(
    response: str,
    ground_truth: str,
    *,
    iou_threshold: str | float = "average",
    det_reward_ratio: dict[str, float] | None = None,
    det_verifier_normalized: bool = False,
    format_ratio: float = 0.1,
    accuracy_ratio: float = 1.0,
    context: dict[str, Any] | None = None,
) -> float:
    """The reward of ``response`` against ``ground_truth`` (see the module docstring)."""
    if iou_threshold != "average" and iou_threshold not in IOU_THRESHOLDS:
        raise ValueError(
            f"iou_threshold: expected 'average' or one of {list(IOU_THRESHOLDS)}, got {iou_threshold!r}"
        )
    opts = _row_options(context or {})
    ratio = {**DEFAULT_RATIO, **(det_reward_ratio or {}), **opts.get("det_reward_ratio", {})}
    normalized = opts.get("det_verifier_normalized", det_verifier_normalized)
    format_ratio = opts.get("format_ratio", format_ratio)
    accuracy_ratio = opts.get("accuracy_ratio", accuracy_ratio)
    truth = parse_boxes(answer_text(ground_truth) if "<answer>" in ground_truth else ground_truth)
    if not truth:
        raise ValueError(f"the ground truth holds no boxes: {ground_truth[:200]!r}")
    pred = parse_boxes(answer_text(response))
    if pred and normalized:
        pred = _normalized(pred, (context or {}).get("image_sizes"))
    accuracy = accuracy_score(pred, truth, ratio, iou_threshold) if pred else 0.0
    weights = accuracy_ratio + format_ratio
    if weights <= 0:
        raise ValueError(f"accuracy_ratio + format_ratio must be > 0, got {accuracy_ratio} + {format_ratio}")
    return (accuracy * accuracy_ratio + format_score(response) * format_ratio) / weights


def _row_options(context: dict[str, Any]) -> dict[str, Any]:
    """The non-null detection options of a row's ``reward_model`` (ROLL's ``verifier_parm`` and
    ratios); ROLL's files hold nulls where a row sets nothing."""
    parm = context.get("verifier_parm") or {}
    out: dict[str, Any] = {}
    ratio = {k: v for k, v in (parm.get("det_reward_ratio") or {}).items() if v is not None}
    if ratio:
        out["det_reward_ratio"] = ratio
    if parm.get("det_verifier_normalized") is not None:
        out["det_verifier_normalized"] = bool(parm["det_verifier_normalized"])
    for key in ("format_ratio", "accuracy_ratio"):
        if context.get(key) is not None:
            out[key] = float(context[key])
    return out


def _normalized(pred: list[Box], image_sizes: Any) -> list[Box]:
    """Pixel coordinates of the (resized) image -> [0, 1000], truncated to integers as ROLL does."""
    if not image_sizes:
        raise ValueError("det_verifier_normalized needs the row's image size (context['image_sizes'])")
    width, height = (float(v) for v in image_sizes[0])
    return [
        (
            (
                int(x1 / width * 1000),
                int(y1 / height * 1000),
                int(x2 / width * 1000),
                int(y2 / height * 1000),
            ),
            lab,
        )
        for (x1, y1, x2, y2), lab in pred
    ]
