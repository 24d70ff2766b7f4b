"""A clip's frames and soundtrack handed from the decode to a mux that starts with it.

The decode (on the render thread) `open`s the media with the clip's uint8 (T, H, W, 3) host buffer, says which
frames have `landed` after each chunk (with a call that waits for its copy to host memory, or None when the frames
are in place already), then `finish`es, or `fail`s. The soundtrack comes with `finish`, or ahead of the frames with
`sound`: the mux then encodes it while the frames decode, and keeps its packets for after the video's, where they
go either way. The mux (on a background thread) reads the frames' shape, iterates the frames, each once it has
landed, and then takes the audio. It sees the frames and audio a finished decode would give it, in the same order,
so the MP4 is byte-identical; only the last chunk's frames are left to encode when the decode ends. A stage that
changes frames (h3gen.stages.vae.FrameFilter) adds a `filter` before the decode starts: each chunk passes through it
on the mux's thread, once landed, before the mux reads it.
"""

from __future__ import annotations

import collections
import threading


class DecodeFailed(Exception):
    """The decode feeding the mux stopped; the mux writes nothing."""


class ArrivingMedia:
    def __init__(self):
        self._changed = threading.Condition()
        self._frames = None
        self._landed = collections.deque()  # (frames landed so far, a wait for their copy or None)
        self._audio = None
        self._done = False
        self._error = None
        self._sample_rate = None
        self._filters = []

    def filter(self, change) -> None:
        """`change(frames)` rewrites each chunk of uint8 (n, H, W, 3) frames in place once it has landed."""
        self._filters.append(change)

    # The decode's side.
    def open(self, frames, sample_rate: int) -> None:
        with self._changed:
            self._frames, self._sample_rate = frames, sample_rate
            self._changed.notify_all()

    def landed(self, count: int, copied=None) -> None:
        """The first `count` frames are in the host buffer, or will be once `copied()` returns."""
        with self._changed:
            self._landed.append((count, copied))
            self._changed.notify_all()

    def sound(self, audio) -> None:
        """The soundtrack, ahead of the frames."""
        with self._changed:
            self._audio = audio
            self._changed.notify_all()

    def finish(self, audio=None) -> None:
        """Every frame has landed; `audio` unless `sound` handed it over."""
        with self._changed:
            if audio is not None:
                self._audio = audio
            self._done = True
            self._changed.notify_all()

    @property
    def finished(self) -> bool:
        """The decode has handed over the frames and the audio, or failed."""
        with self._changed:
            return (self._done and self._audio is not None) or self._error is not None

    def handed(self):
        """(frames, audio, sample_rate) as the decode has handed them over so far (None where it has not)."""
        with self._changed:
            return self._frames, self._audio, self._sample_rate

    def fail(self, error: BaseException) -> None:
        with self._changed:
            self._error = error
            self._changed.notify_all()

    # The mux's side.
    def _wait(self, ready):
        """Until `ready()`; once the decode has failed, every read stops the mux."""
        with self._changed:
            while self._error is None and not ready():
                self._changed.wait()
            if self._error is not None:
                raise DecodeFailed(f"the decode stopped: {type(self._error).__name__}: {self._error}")

    def _opened(self):
        self._wait(lambda: self._frames is not None)
        return self._frames

    @property
    def sample_rate(self) -> int:
        self._opened()
        return self._sample_rate

    @property
    def shape(self):
        return self._opened().shape

    @property
    def dtype(self):
        return self._opened().dtype

    @property
    def ndim(self):
        return self._opened().ndim

    def __len__(self):
        return len(self._opened())

    def __iter__(self):
        frames, available = self._opened(), 0
        for index in range(len(frames)):
            while index >= available:
                self._wait(lambda: self._landed or self._done)
                with self._changed:
                    if not self._landed:
                        raise DecodeFailed(f"the decode ended after {available} of {len(frames)} frames")
                    start, (available, copied) = available, self._landed.popleft()
                if copied is not None:
                    copied()
                for change in self._filters:
                    change(frames[start:available])
            self._wait(lambda: True)  # a failed decode stops the mux at its next frame
            yield frames[index]

    def audio(self):
        self._wait(lambda: self._audio is not None and self._done)
        return self._audio

    def audio_ahead(self):
        """The soundtrack if it came before the first frames landed, else None (it comes with `finish`)."""
        self._wait(lambda: self._audio is not None or self._landed or self._done)
        with self._changed:
            return self._audio


def decoded(clip) -> bool:
    """Whether `clip`'s mux has every frame and the soundtrack it will get (or its decode failed): a clip that hands
    over no media has its frames whole before its mux starts."""
    return clip.arriving is None or clip.arriving.finished
