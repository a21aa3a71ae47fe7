"""Media output: MP4 (H.264 + AAC) and raw .npz writers, and an output-contract checker."""

from h3serve.media.mp4 import EncoderOptions, write_mp4
from h3serve.media.output_probe import ProbeResult, check_output_contract, probe, summary_line
from h3serve.media.raw import read_raw, write_raw

__all__ = [
    "EncoderOptions",
    "ProbeResult",
    "check_output_contract",
    "probe",
    "read_raw",
    "summary_line",
    "write_mp4",
    "write_raw",
]
