"""Data: shard format, streaming IterableDatasets and samplers that are exact, balanced and resumable."""

from torchfn.data._episodic import EpisodicBatchSampler as EpisodicBatchSampler
from torchfn.data._episodic import split_episode as split_episode
from torchfn.data._samplers import ClassBalancedSampler as ClassBalancedSampler
from torchfn.data._stream_balance import StreamBalanceReport as StreamBalanceReport
from torchfn.data._stream_balance import StreamClassBalancer as StreamClassBalancer

__all__ = [
    "ClassBalancedSampler",
    "EpisodicBatchSampler",
    "StreamBalanceReport",
    "StreamClassBalancer",
    "split_episode",
]
