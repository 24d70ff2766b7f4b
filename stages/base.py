"""What every stage shares: a small validated config, loading from a repository, timing around `run`.

`Stage.__call__` is never overridden: it times `run` for the live display and holds every implementation, built-in
or from a plugin, to the contract (docs/plugins.md): `run` returns the clip, and an error that is not an h3gen error
fails the clip with the stage, its kind and its plugin named.
"""

from __future__ import annotations

import dataclasses
import signal
from typing import Any, ClassVar

from h3gen.errors import HOST_MEMORY_FIX, H3genError, host_memory_ran_out, where_it_came_from

STAGE_KINDS = ("encode", "sampler", "vae", "quant", "mux", "cache")
BUILTIN = "h3gen (built-in)"


@dataclasses.dataclass
class NoConfig:
    pass


@dataclasses.dataclass
class Wrapped:
    """The registered stage a `Wrapper` runs inside it, as the preset resolved it: the stage the section named
    before the wrapper took its place (or the section's `[kind.wraps]` table)."""

    name: str = ""
    stage: type | None = None
    config: Any = None


def raised(error: BaseException) -> str:
    """An exception as a failure line names it: its type, then its message when it has one."""
    return type(error).__name__ + (f": {error}" if str(error) else "")


class StageFailed(H3genError):
    """A stage raised something other than an h3gen error, or broke its contract: named with its kind and plugin."""

    exit_code = 1
    plugin_stage = ""  # the label of the plugin's stage that failed ('' for h3gen's own)


class ReturnedRefused(StageFailed):
    """A stage returned, on every rank, something its contract refuses (a decode without its frames, or with frames
    of another shape): the ranks are still in step, so in a group too it costs its clip alone."""


# What to do when a built-in stage computes NaN or infinite values from finite input.
DAMAGED_WEIGHTS_FIX = "download the model again if its weights are damaged, or try a preset without FP8"


class Stage:
    """One step of the pipeline. Subclasses set `kind`, `name`, `Config` and implement `run`."""

    kind: ClassVar[str]
    name: ClassVar[str]
    Config: ClassVar[type] = NoConfig
    description: ClassVar[str] = ""
    origin: ClassVar[str] = BUILTIN  # the plugin that registered the stage (set by the registry)
    on_host: ClassVar[bool] = False  # timed by the host clock: work that never touches the device
    # What the stage can do, declared by its class and read by the run loop and the launcher, never probed. The
    # defaults are the in-line, one-rank behaviour, so a stage that declares nothing works in every run.
    splits_clip: ClassVar[bool] = False  # sampler: renders one clip across a group of ranks after `parallelize`
    hands_over_frames: ClassVar[bool] = False  # vae: fills `clip.arriving` chunk by chunk for a mux started with it
    background: ClassVar[bool] = False  # mux: `submit(clip)` muxes on a thread, `discard_in_flight()` stops it

    @classmethod
    def check_config(cls, config) -> None:
        """Refuse preset values this stage cannot run with: raise h3gen.errors.UsageError naming the value and the
        fix. Called for every stage of a run, a dry run's too, before any weight loads or output file is claimed.
        The default accepts every config."""

    @classmethod
    def check_model(cls, config, repo) -> None:
        """Refuse preset values the model in `repo` (h3gen.models.repo.ModelRepo) cannot take, reading its config
        files only, never its weights: raise UsageError as `check_config` does. Called after `check_config`, for a
        run and a dry run. The default accepts every model."""

    @classmethod
    def check_device(cls, config, device: str, dtype: str) -> None:
        """Refuse preset values this stage cannot run with on `device` ("cpu", "cuda" or "cuda:N") in `dtype` (the
        preset's runtime.dtype, e.g. "bfloat16"): raise UsageError as `check_config` does. Called after
        `check_model`, for a run and a dry run, and again as the stage is built on the device it runs on. The default
        accepts every device."""

    @classmethod
    def refuses_split(cls, config) -> str:
        """Why this stage, with `config`, cannot render one clip across a group of ranks; '' when it can."""
        return "" if cls.splits_clip else f"the {cls.kind} stage '{cls.name}' renders a clip on one rank"

    @classmethod
    def refuses_cache(cls, config) -> str:
        """A sampler: why it cannot take the preset's step cache (h3gen.stages.cache) with `config`; '' when it can."""
        return f"the {cls.kind} stage '{cls.name}' takes no step cache"

    def __init__(self, config, runtime):
        self.config, self.runtime = config, runtime

    def load(self, repo) -> None:
        """Load weights from a `ModelRepo`; stages without weights keep this no-op."""

    def load_note(self) -> str:
        """What the stage chose as it loaded, for the run's "loaded" line (the sampler: its attention backend)."""
        return ""

    def __call__(self, clip, report: bool = True):
        from h3gen.stages.clip import Clip

        try:
            with self.runtime.timer.measure(clip, self.kind, report=report, host=self.on_host):
                result = self.run(clip)
        except H3genError as e:
            self.raise_named(e)
        except (Exception, SystemExit, KeyboardInterrupt) as e:  # a faulty stage costs its clip, named
            if isinstance(e, KeyboardInterrupt) and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                raise  # Ctrl-C itself, where no h3gen handler turns it into a stop (h3gen.run.loop)
            raise self.failed(f"raised {raised(e)}", self.broke_fix(e)) from e
        if not isinstance(result, Clip):
            raise self.failed(f"returned {type(result).__name__} from run(), not the clip",
                              "run(clip) must return the clip it was given (or a copy), with its fields set")
        if self.kind == "mux":
            from h3gen.run.outputs import sha256_of

            self.check_written(result)
            result.sha256 = sha256_of(result.path)  # here, on a background mux's thread, not the run loop's
        return result

    def check_written(self, clip) -> None:
        """A mux wrote the MP4 at `clip.path` with the stamp a rerun reads (`clip.fingerprint`), else a rerun would
        find a clip h3gen did not stamp and leave it as a conflict."""
        from h3gen.run.fingerprint import differences, read_stamp
        from h3gen.run.validate import box_problem, not_an_mp4

        if not clip.path.is_file():
            fix = "a mux's run(clip) writes the MP4 at clip.path (h3gen.stages.mux.write_mp4 does it whole)"
            raise self.failed(f"returned without writing {clip.path}", fix)
        if not_an_mp4(clip.path):
            raise self.failed(f"wrote {clip.path.name}, which is not an MP4",
                              "write it with h3gen.stages.mux.write_mp4, or wrap the pyav mux: docs/plugins.md")
        problem = box_problem(clip.path)  # cut short or padded: its stamp, in the moov box, may be what is missing
        if problem:
            raise self.failed(f"wrote {clip.path.name}, which is {problem}",
                              "write the whole MP4 under a temporary name and rename it to clip.path when closed "
                              "(h3gen.stages.mux.write_mp4 does)")
        if clip.fingerprint:
            stored = read_stamp(clip.path)
            if stored is None or differences(stored, clip.fingerprint):
                raise self.failed(f"wrote {clip.path.name} without the stamp of clip.fingerprint a rerun reads",
                                  "pass comment=h3gen.run.fingerprint.stamp(clip.fingerprint) to write_mp4, or wrap "
                                  "the pyav mux: docs/plugins.md")

    @classmethod
    def label(cls) -> str:
        """This stage as errors name it: its kind, its name and its plugin."""
        return f"{cls.kind} stage '{cls.name}' ({cls.source()})"

    @classmethod
    def raise_named(cls, error: H3genError):
        """Raise a plugin's own error (a refused clip, config or model) with the stage named first, so a user with
        several plugins can tell which refused; h3gen's stages' errors, and one that names the stage already, as they
        are."""
        named = error
        if cls.origin != BUILTIN and not isinstance(error, StageFailed):
            try:
                named = type(error)(f"{cls.label()}: {error.problem}", error.fix)
            except TypeError:  # a subclass of the plugin's that takes other arguments
                pass
        if named is error:
            raise error
        raise named from error

    @classmethod
    def failed(cls, what: str, fix: str = "") -> StageFailed:
        """An error naming this stage, its kind and its plugin (from the class too, before any instance exists)."""
        failed = StageFailed(f"{cls.label()} {what}", fix)
        failed.plugin_stage = cls.label() if cls.origin != BUILTIN else ""
        return failed

    @classmethod
    def broke_fix(cls, error: BaseException | None = None) -> str:
        """What to do about this stage raising `error`: the host's memory running out is no one's bug; else a
        plugin's is its author's to fix, h3gen's own a bug to report."""
        if error is not None and host_memory_ran_out(error):
            return f"out of host memory: {HOST_MEMORY_FIX}"
        if cls.origin == BUILTIN:
            return f"{where_it_came_from()}; report it as an h3gen bug with that"
        return f"{where_it_came_from()}; fix the stage, or pick another in the preset"

    @classmethod
    def source(cls) -> str:
        return "built into h3gen" if cls.origin == BUILTIN else f"from plugin '{cls.origin}'"

    def run(self, clip):
        raise NotImplementedError

    def prepare(self, clip) -> None:
        """Called with the next clip while the device still works on this one: start host-side work `run` will need
        (the built-in sampler draws the clip's seeded noise), on a thread. The default does nothing."""

    def submit(self, clip, stage=None):
        """A background mux (`background = True`): start muxing `clip` on a thread by calling `stage(clip, False)`
        (`stage` is a wrapper of this mux, or None for this one), and return a Future of the clip; or return None to
        be called in line after the decode."""
        return None

    def discard_in_flight(self) -> None:
        """A background mux: stop the writes in flight now (a signal ends the run), leaving no partial file."""

    def parallelize(self, group) -> None:
        """Spread this stage over `group`, a torch.distributed process group of two or more ranks that render one
        clip together. Called once after `load` on every rank of the group; afterwards every rank calls the stage
        with the same clip, and each must come out with the state the next stage reads on that rank. The default
        leaves every rank doing the whole work (replicated), which is always correct and right for cheap stages."""

    def unload(self) -> None:
        """Drop weights so the memory can serve another stage."""


class Wrapper(Stage):
    """A stage that runs another registered stage of its kind inside it (composition, not subclassing): its Config
    has a `wraps: Wrapped` field, which the preset fills with the stage the section named before (`--set
    vae.use=grayscale` on h3-base wraps h3-base's `fast` decode, with its knobs), or with a `[vae.wraps]` table.

    The inner stage is loaded, parallelized and unloaded with the wrapper, and its capabilities are the wrapper's
    (`hands_over_frames` only where the wrapper's class also declares it: it then filters `clip.arriving` itself);
    its `check_config` and `check_model` are called besides the wrapper's own (`wrapped_chain`);
    a subclass overrides `run`, calling `self.inner.run(clip)` where the wrapped stage's work belongs (a wrapped
    background mux runs the wrapper's `run` on its threads)."""

    def __init__(self, config, runtime):
        super().__init__(config, runtime)
        wrapped = config.wraps
        if wrapped.stage is None:
            raise StageFailed(f"{self.kind} stage '{self.name}' wraps no stage",
                              f"name the stage it wraps: [{self.kind}.wraps] use = \"...\"")
        self.inner = wrapped.stage(wrapped.config, runtime)
        # A vae wrapper that edits clip.frames after the inner decode would edit frames already handed to the mux: the
        # inner stage hands its frames over only under a wrapper class that says it takes them so (FrameFilter).
        self.splits_clip = self.inner.splits_clip
        self.hands_over_frames = self.inner.hands_over_frames and type(self).hands_over_frames
        self.background, self.on_host = self.inner.background, self.inner.on_host

    @classmethod
    def refuses_split(cls, config) -> str:
        wrapped = config.wraps
        return wrapped.stage.refuses_split(wrapped.config) if wrapped.stage is not None else super().refuses_split(config)

    def load(self, repo) -> None:
        self.inner.load(repo)

    def load_note(self) -> str:
        return self.inner.load_note()

    def parallelize(self, group) -> None:
        self.inner.parallelize(group)

    def run(self, clip):
        return self.inner.run(clip)

    def prepare(self, clip) -> None:
        self.inner.prepare(clip)

    def submit(self, clip, stage=None):
        return self.inner.submit(clip, stage or self)  # on the inner mux's threads, through this wrapper's run

    def discard_in_flight(self) -> None:
        self.inner.discard_in_flight()

    def unload(self) -> None:
        self.inner.unload()


def wrapped_chain(stage, config):
    """(stage class, config) of a section's stage, then of each stage it wraps, innermost last."""
    while True:
        yield stage, config
        wrapped = getattr(config, "wraps", None)
        if not isinstance(wrapped, Wrapped) or wrapped.stage is None:
            return
        stage, config = wrapped.stage, wrapped.config
