"""Data: shard format, streaming IterableDatasets and samplers that are exact, balanced and resumable."""

from torchfn.data._arrow import HFDiskSource as HFDiskSource
from torchfn.data._arrow import ParquetSource as ParquetSource
from torchfn.data._audit import Auditor as Auditor
from torchfn.data._audit import AuditReport as AuditReport
from torchfn.data._audit import audit_plan as audit_plan
from torchfn.data._convert import write_shards as write_shards
from torchfn.data._episodic import EpisodicBatchSampler as EpisodicBatchSampler
from torchfn.data._episodic import split_episode as split_episode
from torchfn.data._fsio import RemoteNpy as RemoteNpy
from torchfn.data._plan import Plan as Plan
from torchfn.data._plan import global_order as global_order
from torchfn.data._plan import plan as plan
from torchfn.data._pqdecode import CorruptParquetError as CorruptParquetError
from torchfn.data._prefetch import DevicePrefetcher as DevicePrefetcher
from torchfn.data._prefetch import prefetch_to_device as prefetch_to_device
from torchfn.data._samplers import ClassBalancedSampler as ClassBalancedSampler
from torchfn.data._shards import CorruptShardError as CorruptShardError
from torchfn.data._shards import ShardReader as ShardReader
from torchfn.data._shards import ShardWriter as ShardWriter
from torchfn.data._shards import VerifyReport as VerifyReport
from torchfn.data._shards import read_manifest as read_manifest
from torchfn.data._shards import verify_shards as verify_shards
from torchfn.data._sources import NumpySource as NumpySource
from torchfn.data._sources import SampleSource as SampleSource
from torchfn.data._sources import ShardSource as ShardSource
from torchfn.data._sources import collate_values as collate_values
from torchfn.data._stream import StreamingDataset as StreamingDataset
from torchfn.data._stream import StreamingLoader as StreamingLoader
from torchfn.data._stream import state_from_stateful_loader as state_from_stateful_loader
from torchfn.data._stream_balance import StreamBalanceReport as StreamBalanceReport
from torchfn.data._stream_balance import StreamClassBalancer as StreamClassBalancer
from torchfn.data._tar import TarError as TarError
from torchfn.data._tar import TarSource as TarSource
from torchfn.data._tar import decode_member as decode_member
from torchfn.data._tools import DataInfo as DataInfo
from torchfn.data._tools import DataStats as DataStats
from torchfn.data._tools import detect_format as detect_format
from torchfn.data._tools import inspect_source as inspect_source
from torchfn.data._tools import open_source as open_source
from torchfn.data._tools import source_stats as source_stats
from torchfn.data._tools import verify_source as verify_source

__all__ = [
    "AuditReport",
    "Auditor",
    "ClassBalancedSampler",
    "CorruptParquetError",
    "CorruptShardError",
    "DataInfo",
    "DataStats",
    "DevicePrefetcher",
    "EpisodicBatchSampler",
    "HFDiskSource",
    "NumpySource",
    "ParquetSource",
    "Plan",
    "RemoteNpy",
    "SampleSource",
    "ShardReader",
    "ShardSource",
    "ShardWriter",
    "StreamBalanceReport",
    "StreamClassBalancer",
    "StreamingDataset",
    "StreamingLoader",
    "TarError",
    "TarSource",
    "VerifyReport",
    "audit_plan",
    "collate_values",
    "decode_member",
    "detect_format",
    "global_order",
    "inspect_source",
    "open_source",
    "plan",
    "prefetch_to_device",
    "read_manifest",
    "source_stats",
    "split_episode",
    "state_from_stateful_loader",
    "verify_shards",
    "verify_source",
    "write_shards",
]
