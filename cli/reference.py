"""The man page's reference sections in words: the prompts file, the environment, the files a run writes, the exit
status, examples. Each says what the code does, with the code's own numbers where it has them.

Each section is a list of paragraphs (str), terms with what they are ((term, text)) and examples (Example).
"""

from __future__ import annotations

import dataclasses

from h3gen.cli.ui import HEARTBEAT_S
from h3gen.inputs.media import MIN_VIDEO_FRAMES
from h3gen.inputs.prompts import MAX_CLIP_BYTES
from h3gen.inputs.request import FPS, MAX_SECONDS, MIN_SECONDS, SAMPLE_RATE, frames_for_duration
from h3gen.models.tiny import TINY_VERSION
from h3gen.run.outputs import MANIFEST

CACHE = "$XDG_CACHE_HOME/h3gen"


@dataclasses.dataclass(frozen=True)
class Example:
    command: str
    text: str


def seconds(value: float) -> str:
    return f"{value:g} s"


PROMPTS_FILE = [
    "The PROMPTS file of h3gen render, read as UTF-8 (a byte-order mark at its start is dropped; bytes that are not "
    "UTF-8 stop the run, naming the line). Lines end at a line feed, a carriage return before it is dropped, and "
    "U+2028 and the other Unicode separators are text inside a line, so every line number is the one an editor "
    "shows. Each line is trimmed of the whitespace around it; a line that is then empty, or starts with #, is "
    "skipped. A line that starts with { or [ is JSON and must be one object (a prompt that itself starts with a "
    'bracket goes in {"prompt": "..."}); any other line is a prompt as it stands. Both kinds mix in one file.',
    "A JSON line has these fields, each of the JSON type given (true and false are no number); any other field, "
    "or another type, stops the run.",
    ("prompt", "string, required: the text, trimmed of the whitespace around it, not empty. A JSON string can hold "
               "any character, line breaks and control characters included, written as JSON escapes."),
    ("id", "string: the clip's file name, ID.mp4 (ID itself when it ends in .mp4): ASCII letters, digits, '.', '_' and "
           "'-', starting with a letter or digit, at most 128 characters, each id once in the file. Without one, "
           "the name is h3-HASH.mp4, HASH 12 hex digits of a SHA-256 of the preset's name, the seed, the prompt and "
           "the media files' content: a rerun finds the same file, from another folder too."),
    ("seed", "integer, 0 to 2**63 - 1: the noise seed. Default: --seed plus the prompt's index, its place among "
             "the prompts from 0 (blank lines and comments not counted)."),
    ("duration", f"number, {seconds(MIN_SECONDS)} to {seconds(MAX_SECONDS)}: the clip gets the fewest frames of "
                 f"the form 17n+5 (the video VAE's) at {FPS} fps that last that long, at most {seconds(MAX_SECONDS)} "
                 f"({frames_for_duration(MIN_SECONDS)} frames for {seconds(MIN_SECONDS)}, "
                 f"{frames_for_duration(MAX_SECONDS)} for {seconds(MAX_SECONDS)}). Default: the preset's "
                 "request.duration."),
    ("width, height", "integers: pixels, multiples of 32 (at least 32), width over height between 1:4 and 4:1. "
                      "Default: the preset's request.width and request.height; with keyframes, give both or "
                      "neither: without them the first keyframe's (else the last's) aspect ratio sets the size on the "
                      "canvas (--size, else the preset's): the canvas's short edge, scaled down to the canvas's "
                      "area, then each side rounded to a multiple of 32 and at least 32, which can leave it a "
                      "little above that area (a 2:1 keyframe on 1344x768 gives 1440x704; a 10:3 one on 64x32, "
                      "96x32). The first keyframe is stretched onto the clip's size, a last one beside it scaled to "
                      "cover it and center-cropped. A size whose estimated peak "
                      "device memory is more than "
                      f"{MAX_CLIP_BYTES // 2**30} GiB (8 GPUs of 288 GiB) is refused."),
    ("first_frame, last_frame", "strings: fl2va, the image the video starts from, ends on, or both: a file PIL "
                                "reads (PNG, JPEG, WebP), its EXIF orientation applied, its aspect ratio between "
                                "1:4 and 4:1. Not with references."),
    ("references", "array of strings: ref2va, image, video and audio files in the order the model reads them, each "
                   "known by what it holds (an image PIL reads, else the streams PyAV finds; a video brings its "
                   "soundtrack): at most 9 images, 3 videos and 3 audio files, 12 in all (the limits of diffusers' "
                   "MiniMaxH3Ref2VASetupStep), never audio alone. A video needs a frame rate, an aspect ratio "
                   f"between 1:4 and 4:1 and {MIN_VIDEO_FRAMES} frames at {FPS} fps (at least "
                   f"{(MIN_VIDEO_FRAMES - 0.5) / FPS:.2f} s, as its length rounds); "
                   f"audio must be mono or stereo, at {SAMPLE_RATE} Hz unless torchaudio is installed to resample "
                   "it."),
    "Media paths are absolute, or relative to the prompts file's folder (~ is expanded; for a link, the folder of "
    "the file it leads to; for prompts read from a pipe, the current folder). The task follows from the "
    "fields: none of them, t2va; keyframes, fl2va; references, ref2va (which runs the repository's "
    "transformer_ref/ partition). A preset's adapter contract can restrict the tasks. Every line is checked before "
    "any weight loads: bad lines, or a file without prompts, stop the run with exit status 2, an error line naming "
    "the file and line for each bad line (the first 20); the preset's [request] values, the defaults a line takes, are checked alike, naming the preset or "
    "the --set that gave them. A prompt's length in tokens is checked by the text encoder's tokenizer, as the "
    "prompts are encoded: one over encode.max_tokens fails its own clip, and the run goes on. --shard I/N keeps the "
    "prompts whose index is I modulo N.",
]

ENVIRONMENT = [
    ("H3GEN_MODEL", "The model directory when --model is not given (render, bench); an error naming the directory "
                    "then starts with H3GEN_MODEL:."),
    ("H3GEN_LOAD_PLUGINS", "Comma-separated names of the installed plugins (entry points of the h3gen group) to "
                           "load; unset or empty: all; none: no plugin. h3gen's own stages and presets are always "
                           "there; a name no installed plugin has is reported as a failed plugin."),
    ("H3GEN_STRICT_PLUGINS", "1 (or true, yes, on) stops the command when a plugin fails to load, as "
                             "--strict-plugins; otherwise it is reported and skipped."),
    ("H3GEN_DEBUG", "Anything but empty or 0 prints a failure's traceback besides its one line, as --traceback "
                    "(which sets it, for the workers too)."),
    ("H3GEN_HEARTBEAT_S", f"Seconds between two lines of a clip's sampler progress when stderr is not a terminal "
                          f"(default {HEARTBEAT_S:g}; 0: a line at every step; inf: none)."),
    ("H3GEN_COMMIT", "The commit h3gen bench writes into its results: a hash of 7 to 40 lowercase hex digits, "
                     "anything else refused (default: git rev-parse HEAD in h3gen's source folder)."),
    ("TERM", "dumb: stderr gets a log's timestamped lines on a terminal too, not a live display drawn over itself."),
    ("NO_COLOR", "Set: the live display draws without colours (read by rich)."),
    ("XDG_CACHE_HOME", "Where the user cache directory is (FILES)."),
    ("OMP_NUM_THREADS", "CPU threads per process. On the CPU a clip's bytes depend on it (MKL and ATen split their "
                        "sums by thread): one process with the same value renders the same clip. Unset, each "
                        "worker of --cpu-workers or --gpus gets the machine's cores divided by the workers per "
                        "machine. A value OpenMP cannot take (not a whole number from 1) is refused."),
    ("PYTORCH_ALLOC_CONF", "Set to expandable_segments:True when neither it nor PYTORCH_CUDA_ALLOC_CONF is set: "
                           "torch's allocator then grows its segments page by page, so memory a streamed or "
                           "chunked run frees in pieces serves larger tensors later (a budget holds)."),
    ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF's older name: when either is set, h3gen leaves the allocator's "
                                "settings as given. A text torch cannot split into key:value entries (torch stops "
                                "as it starts on one) is refused."),
    ("TORCH_CPP_LOG_LEVEL", "Set to ERROR when unset: torch's C++ warnings, each with a stack (a multi-node "
                            "run's lost connection on every try), are left out, and h3gen says what happened in a "
                            "line of its own. WARNING shows them."),
    ("MKL_CBWR", "Set to AUTO when unset (MKL's conditional numerical reproducibility), so one seed renders one "
                 "clip whatever ran before in the process."),
]

FILES = [
    "OUT is the -o directory of h3gen render, NAME a clip's file name (PROMPTS FILE).",
    ("OUT/NAME.mp4", f"A clip: H.264 at {FPS} fps and AAC stereo at {SAMPLE_RATE} Hz, its render fingerprint in "
                     "the comment tag. Written as OUT/.NAME.mp4.partial.mp4 and renamed when complete, so a "
                     "stopped run never leaves a partial MP4; a later run removes the partial files a killed one "
                     "left."),
    ("OUT/NAME.latents.safetensors", "With --save-latents: the clip's final video and audio latents (float32), "
                                     "written as OUT/.NAME.latents.safetensors.partial and renamed; removed again "
                                     "when the clip then fails or a signal discards it."),
    (f"OUT/{MANIFEST}", "One JSON line per clip and event of every run, appended whole under a lock: the record "
                        "--json prints, plus time (Unix seconds) and pid."),
    ("OUT/.NAME.mp4.lock", "The claim of the run rendering NAME.mp4: a lock the kernel drops when that process "
                           "ends, removed when the clip is done. A clip another run holds is left to it (busy)."),
    (f"{CACHE}/embeddings/", "The embedding cache: KEY[0:2]/KEY.safetensors per prompt, KEY a SHA-256 of the text "
                             "encoder's and tokenizer's files, the encode settings (layer, dtype, quant stage, "
                             "device kind) and the prompt; a damaged entry is written again. --set "
                             "encode.cache=false turns it off, --set encode.cache_dir=DIR puts it in DIR."),
    (f"{CACHE}/tiny-v{TINY_VERSION}/", "The embedded tiny model, written on first use (h3gen tiny DIR writes it to "
                                       "DIR)."),
    ("h3gen-bench/", "h3gen bench's -o directory (this one, in the current directory, by default): STAMP.json "
                       "(the records, the device, the versions and the commit), STAMP.md (the table) and STAMP.png "
                       "(the chart); with --batch, STAMP-batch.json and STAMP-batch.md. STAMP is the UTC time they "
                       "are written, as 2026-01-31T120000Z."),
    f"{CACHE} is the user cache directory (platformdirs' user_cache_dir): ~/.cache/h3gen when XDG_CACHE_HOME is "
    "unset, ~/Library/Caches/h3gen on macOS.",
]

RECORD = [
    "h3gen render --json prints one JSON object a line (JSON Lines) on stdout as each clip finishes, and OUT/"
    f"{MANIFEST} gets the same, with time and pid. README.md's \"Output and exit codes\" says more of each field.",
    ("path", "The MP4, as -o was given (relative stays relative)."),
    ("id, line, seed", "The prompt's id (or null), its line in the prompts file, its seed."),
    ("preset", "The preset's name."),
    ("status", "ok (written by this run), skipped (there, rendered with these settings), busy (another run renders "
               "it), conflict (there from other settings, or not h3gen's: left alone) or failed."),
    ("ok", "true for ok, skipped and busy."),
    ("error", "Why it failed or conflicts, with the fix; null otherwise."),
    ("seconds", "Seconds per stage (encode, sampler, vae, mux) and parts of them (conditions, dit_forwards, "
                "cache_check, vae_video, vae_audio, transfer): add the stages, not every key."),
    ("end_to_end_s, rtf", "Seconds from the first stage to the written file, and that over the media's duration; "
                          "null unless ok."),
    ("media_s, frames", "The clip's duration and frame count."),
    ("task, width, height", "t2va, fl2va or ref2va, and the size it renders at."),
    ("forwards, forwards_reused", "DiT forwards run, and how many a step cache shortened; null unless ok."),
    ("peak_gib", "The device's peak memory for the clip; null on the CPU."),
    ("attention", "The DiT's attention backend; null when not rendered."),
    ("fingerprint", "The digest of everything that decides the clip's bytes: model, resolved preset, request, "
                    "stage versions. A rerun skips a clip there with the same one, leaves one with another as a "
                    "conflict (--redo-conflicts renders those again, --force every clip) and renders again one "
                    "that is damaged."),
    ("sha256", "The MP4's bytes as this run wrote them: h3gen validate and a rerun tell a clip changed since by it; "
               "null unless ok."),
    ("memory_plan", "On a GPU, the run's memory plan (vram_gib, streamed_blocks, estimated_peak_gib and more); null "
                    "on the CPU."),
]

EXIT_STATUS = [
    ("0", "Every clip was written, or was already there (render); every file is valid (validate)."),
    ("1", "Some clips failed or are in conflict with a file there (from other settings, or not h3gen's), the "
          "others written, the summary listing each with its reason (render); a write the run cannot do without "
          "failed (an output disk too full for any MP4 among them), a worker failed, or h3gen hit a bug; a file is "
          "not valid (validate); a matched pair of clips in two folders could not be compared, the others were "
          "(compare)."),
    ("2", "A usage error: bad options, prompts file, preset, model directory or output directory; a clip too large "
          "for the host memory free on the CPU, or a device memory budget the GPU cannot give; a file to "
          "validate that does not exist, or a directory without clips; clips to compare that are not MP4s of the same shape, or two folders with "
          "no clip in common."),
    ("130, 143, 129", "Stopped by SIGINT, SIGTERM or SIGHUP: the clip on the device is discarded, a clip already "
                      "decoded has its background mux finished first, the clips written are kept, and the same "
                      "command resumes. A second signal ends the process at once."),
    ("141", "stdout's reader has gone (h3gen render ... --json | head -1): the run ends at the next clip (or at "
            "the end, when the last clip had already started), as SIGPIPE ends other tools, with the clips written "
            "so far counted and nothing partial left."),
]

EXAMPLES = [
    Example("h3gen render prompts.txt -o out/", "Render every prompt on the embedded tiny model (noise, in seconds):"),
    Example("h3gen render prompts.txt -o out/ --model ~/models/MiniMax-H3 --preset h3-base --json",
            "Real clips, a JSON record per clip on stdout:"),
    Example("h3gen render prompts.txt -o out/ --model ~/models/MiniMax-H3 --dry-run",
            "What a run would render, skip or leave as a conflict, loading no weights:"),
    Example("h3gen render prompts.txt -o out/ --model ~/models/MiniMax-H3 --gpus 8",
            "Eight GPUs, the layout picked from the prompt count:"),
    Example("h3gen render prompts.txt -o out/ --model ~/models/MiniMax-H3 --shard $SLURM_ARRAY_TASK_ID/4",
            "One of four independent runs over one file (a Slurm array of 0-3):"),
    Example("h3gen presets show h3-base --set sampler.steps=25 --toml",
            "A preset of one's own, to save and pass as --preset FILE:"),
    Example("h3gen validate out/", "Check the clips:"),
    Example("h3gen compare fast/ ref/ --json", "How far fast presets' clips are from the reference ones:"),
    Example("h3gen --install-completion zsh", "Tab completion in zsh:"),
]
