"""`h3serve selftest`: does this install work on these devices, with these flags, and how fast — in minutes,
with no checkpoint download (random weights at the released width, the tiny checkpoint for the real request).

Sized for the default budget of 300 s on one GPU: numerics on 3 released-width blocks at 448x256, 22 frames
(seconds); attention kernels on 4,096 rows with the released heads; compile: one regional compile of those
blocks (the longest check, about a minute); memory paths: the same 3 blocks resident, staged and streamed;
throughput: 3 blocks at 1344x768, 124 frames, 3 timed forwards; end to end: a 64x64, 4 s, 3-step request
and a 32x32, 6 s continuation in two windows of one step. Multi-GPU (skipped on one GPU): one session of fresh
ranks on an even number of GPUs, 5 timed calls per collective at one block's sizes for the throughput request
and the 3 blocks at the numerics shape under TP2 and Ulysses-2, capped at 240 s.
On CPU every DiT check uses a reduced width (64 hidden, 2 heads) so the whole run takes seconds, and the
multi-GPU checks run on two gloo processes (process start dominates: about 30 s on a loaded 2-core host).
"""
