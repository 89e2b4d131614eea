"""Metrics that need every evaluation sample at once (ranks, not per-batch means)."""

from __future__ import annotations

import numpy as np


def auroc(labels: np.ndarray, scores: np.ndarray) -> float | None:
    """Area under the ROC curve of ``scores`` for binary ``labels`` (NaN labels are unknown and
    left out), from the Mann-Whitney rank sum with tied scores given their average rank.

    None when the known labels hold only one class: the area is undefined then, and 0.5 would
    read as a model that guesses.
    """
    labels, scores = np.asarray(labels, dtype=np.float64), np.asarray(scores, dtype=np.float64)
    if labels.shape != scores.shape or labels.ndim != 1:
        raise ValueError(f"auroc: expected two 1-D arrays of one length, found "
                         f"{labels.shape} and {scores.shape}")  # fmt: skip
    known = ~np.isnan(labels)
    positive, scores = labels[known] > 0.5, scores[known]
    pos = int(positive.sum())
    neg = len(positive) - pos
    if pos == 0 or neg == 0:
        return None
    _, group, counts = np.unique(scores, return_inverse=True, return_counts=True)
    average_rank = np.cumsum(counts) - (counts - 1) / 2  # 1-based, ties share their mean rank
    rank_sum = average_rank[group][positive].sum()
    return float((rank_sum - pos * (pos + 1) / 2) / (pos * neg))
