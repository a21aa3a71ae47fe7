"""Chunk by chunk, the video VAE's windows give the whole-timeline decode's frames; the audio tiles the timeline."""

from __future__ import annotations

import torch

from h3serve.model.decoder import Decoder
from h3serve.model.realtime.decode import ChunkAudioDecoder, ChunkVideoDecoder
from h3serve.model.stream_decode import decode_chunks, rgb8
from h3serve.rules import realtime_geometry as rt


def test_windows_over_two_requests_equal_the_whole_decode(realtime_parts):
    decoder = Decoder(realtime_parts.components, realtime_parts.device)
    chunks = [rt.chunk(i) for i in range(8)]
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 24, chunks[-1].video_stop, 4, 4, generator=g)
    streamed = ChunkVideoDecoder(decoder)
    pieces = [streamed.push(latents[:, :, c.video_start : c.video_stop]) for c in chunks]
    assert [p.shape[0] for p in pieces] == [rt.published_frames(c.index, 8)[1] for c in chunks[:-1]] + [17]
    pieces.append(streamed.flush())
    with torch.no_grad():
        whole = [rgb8(piece, 0) for piece in decode_chunks(decoder.components.vae, decoder.denormalised_video(latents))]
    assert torch.equal(torch.cat(pieces), torch.cat(whole))
    assert torch.cat(pieces).shape[0] == rt.session_frames(8) == 243


def test_audio_ranges_tile_the_samples(realtime_parts):
    decoder = Decoder(realtime_parts.components, realtime_parts.device)
    audio = ChunkAudioDecoder(decoder)
    g = torch.Generator().manual_seed(1)
    audio.append(torch.randn(2, 32, 207, generator=g))
    first = audio.decode(0, rt.samples_at(34))
    second = audio.decode(rt.samples_at(34), rt.samples_at(68))
    assert first.shape == (2, 45333) and second.shape == (2, rt.samples_at(68) - 45333) and first.abs().max() > 0
    tail = audio.decode(rt.samples_at(119), rt.samples_at(124) + 2000)  # past the generated latents: silence
    assert tail[:, -400:].abs().max() == 0 and tail[:, :100].abs().max() > 0
