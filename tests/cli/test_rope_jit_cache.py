"""rope-jit-cache end to end: many processes at once, damaged entries, unusable and full
directories, killed writers, stale versions, hostile roots, and the command line itself.

Run by ctest as `python3 test_rope_jit_cache.py` with ROPE_JIT_CACHE_TOOL naming the binary.
Compiling needs NVRTC, not a GPU; tests that compile are skipped where NVRTC is missing.
"""
import ctypes
import json
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cache_entry_format  # noqa: E402

TOOL = os.environ.get("ROPE_JIT_CACHE_TOOL", "")
WARNING = "rope_jit: warning:"

# 5 head dims x 2 directions x 2 position modes = 20 distinct kernels.
TWENTY_SPECS = ["--head-dim", "64,80,96,128,256", "--direction", "forward,backward",
                "--positions", "implicit,indices", "--dtype", "bf16"]
FIVE_SPECS = ["--head-dim", "32,64,96,128,160"]


def tool_env(extra_env=None):
    env = dict(os.environ)
    for name in ("ROPE_JIT_CACHE_DIR", "ROPE_JIT_CACHE_RO_DIRS", "ROPE_JIT_QUIET"):
        env.pop(name, None)
    env.update(extra_env or {})
    return env


def run_tool(*args, preexec_fn=None, timeout=600, extra_env=None):
    return subprocess.run([TOOL, *args], capture_output=True, text=True, env=tool_env(extra_env),
                          preexec_fn=preexec_fn, timeout=timeout)


def start_tool(*args):
    return subprocess.Popen([TOOL, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=tool_env())


def read_bytes(path):
    with open(path, "rb") as file:
        return file.read()


def write_bytes(path, data):
    with open(path, "wb") as file:
        file.write(data)


def warnings_in(stderr):
    return [line for line in stderr.splitlines() if line.startswith(WARNING)]


def nvrtc_available():
    if not TOOL:
        return False
    info = run_tool("info", "--json", "--cache-dir", tempfile.gettempdir() + "/rope_jit_cli_probe")
    shutil.rmtree(tempfile.gettempdir() + "/rope_jit_cli_probe", ignore_errors=True)
    return info.returncode == 0 and json.loads(info.stdout)["nvrtc_version"] != ""


HAVE_NVRTC = nvrtc_available()


def driver_present():
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False
def nvml_gpus():
    """(name, major, minor) of each GPU NVML lists, through ctypes; [] without NVML or GPU."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return []
    if nvml.nvmlInit_v2() != 0:
        return []
    gpus = []
    count = ctypes.c_uint(0)
    if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0:
        for i in range(count.value):
            handle, name = ctypes.c_void_p(), ctypes.create_string_buffer(96)
            major, minor = ctypes.c_int(0), ctypes.c_int(0)
            if (nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)) == 0
                    and nvml.nvmlDeviceGetName(handle, name, 96) == 0
                    and nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) == 0):
                gpus.append((name.value.decode(), major.value, minor.value))
    nvml.nvmlShutdown()
    return gpus


needs_nvrtc = unittest.skipUnless(HAVE_NVRTC, "NVRTC is not available: nothing can be compiled")


class CacheTestCase(unittest.TestCase):
    def setUp(self):
        self.assertTrue(TOOL and os.access(TOOL, os.X_OK), "set ROPE_JIT_CACHE_TOOL to the rope-jit-cache binary")
        self.scratch = tempfile.mkdtemp(prefix="rope_jit_cli_")
        self.root = os.path.join(self.scratch, "cache")

    def tearDown(self):
        for path, dirs, _ in os.walk(self.scratch):
            for name in dirs:
                try:
                    os.chmod(os.path.join(path, name), 0o700)
                except OSError:
                    pass
        shutil.rmtree(self.scratch, ignore_errors=True)

    def tool(self, *args, expect=0, **kwargs):
        result = run_tool(*args, **kwargs)
        self.assertEqual(result.returncode, expect,
                         f"rope-jit-cache {' '.join(args)}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}")
        return result

    def prewarm(self, *spec_args, root=None, expect=0, **kwargs):
        result = self.tool("--cache-dir", root or self.root, "prewarm", "--target", "sm_90", "--json", *spec_args,
                           expect=expect, **kwargs)
        return json.loads(result.stdout), result.stderr

    def verify(self, root=None, expect=None):
        result = run_tool("--cache-dir", root or self.root, "verify", "--json")
        if expect is not None:
            self.assertEqual(result.returncode, expect, result.stdout + result.stderr)
        return json.loads(result.stdout)

    def items(self, state, root=None):
        return [item for item in self.verify(root)["items"] if item["state"] == state]


@needs_nvrtc
class ConcurrencyTest(CacheTestCase):
    def test_eight_processes_prewarming_the_same_twenty_specs_at_once_compile_each_once_and_leave_twenty_good_entries(self):
        processes = [start_tool("--cache-dir", self.root, "prewarm", "--target", "sm_90", "--json", "--jobs", "2",
                                *TWENTY_SPECS) for _ in range(8)]
        results = [(process.wait(timeout=600), *process.communicate()) for process in processes]
        compiled_by = {}  # kernel -> how many processes compiled it
        totals = {"compiled": 0, "cached": 0, "written": 0}
        for index, (code, stdout, stderr) in enumerate(results):
            self.assertEqual(code, 0, f"process {index}\n{stdout}\n{stderr}")
            self.assertEqual(warnings_in(stderr), [], f"process {index}")
            report = json.loads(stdout)
            self.assertEqual(report["failed"], 0)
            for name in totals:
                totals[name] += report[name]
            for kernel in report["kernels"]:
                self.assertIn(kernel["result"], ("compiled", "cached"), kernel)
                name = kernel["target"] + " " + json.dumps(kernel["spec"], sort_keys=True)
                compiled_by[name] = compiled_by.get(name, 0) + (kernel["result"] == "compiled")
        # The others waited for the one compiling a kernel and loaded what it stored.
        self.assertEqual(len(compiled_by), 20)
        self.assertEqual(sorted(compiled_by.values()), [1] * 20, compiled_by)
        self.assertEqual(totals, {"compiled": 20, "cached": 8 * 20 - 20, "written": 20})

        report = self.verify(expect=0)
        self.assertEqual([item["state"] for item in report["items"]], ["ok"] * 20, report["items"])
        leftovers = [name for _, _, files in os.walk(self.root) for name in files if name.startswith(".tmp-")]
        self.assertEqual(leftovers, [])
        self.assertEqual(len({item["key"] for item in report["items"]}), 20)
        # The compile locks: a few empty private files, outside what list and verify report.
        locks = os.listdir(os.path.join(self.root, "locks"))
        self.assertTrue(0 < len(locks) <= 20, locks)
        for name in locks:
            path = os.path.join(self.root, "locks", name)
            self.assertRegex(name, r"^[0-9a-f]{4}\.lock$")
            self.assertEqual((os.stat(path).st_size, stat.S_IMODE(os.stat(path).st_mode)), (0, 0o600), name)


@needs_nvrtc
class DamageTest(CacheTestCase):
    def test_each_kind_of_damage_is_reported_by_verify_and_recompiled_with_a_warning_by_the_next_prewarm(self):
        self.prewarm(*FIVE_SPECS)
        entries = sorted(item["path"] for item in self.items("ok"))
        self.assertEqual(len(entries), 5)
        truncated, flipped, echo, empty, directory = entries

        data = read_bytes(truncated)
        write_bytes(truncated, data[: len(data) // 2])
        data = bytearray(read_bytes(flipped))
        data[-1] ^= 0x01  # the payload is the end of the file
        write_bytes(flipped, bytes(data))
        # A well-formed entry with a valid checksum, but echoing another key than its name's.
        _, key, spec, payload = cache_entry_format.parse(read_bytes(echo))
        other_key = "0" * 64 if key != "0" * 64 else "1" * 64
        write_bytes(echo, cache_entry_format.serialize(other_key, spec, payload))
        write_bytes(empty, b"")
        os.unlink(directory)
        os.mkdir(directory)  # (empty: one that holds anything is not the cache's, test below)

        report = self.verify(expect=1)
        problems = {item["path"]: item["problem"] for item in report["items"] if item["state"] == "damaged"}
        expected = {truncated: "truncated", flipped: "checksum", echo: "key echo", empty: "empty",
                    directory: "directory"}
        self.assertEqual(set(problems), set(expected), report["items"])
        for path, word in expected.items():
            self.assertIn(word, problems[path], path)
        self.assertEqual(len(self.items("ok")), 0)

        result, stderr = self.prewarm(*FIVE_SPECS)
        self.assertEqual((result["compiled"], result["cached"], result["failed"]), (5, 0, 0))
        warnings = warnings_in(stderr)
        self.assertEqual(len(warnings), 5, stderr)
        for path in expected:
            self.assertEqual(sum(path in warning and "set aside" in warning for warning in warnings), 1, path)

        report = self.verify(expect=0)
        states = sorted(item["state"] for item in report["items"])
        self.assertEqual(states, ["ok"] * 5 + ["set-aside"] * 5)
        self.tool("--cache-dir", self.root, "prune")
        self.assertEqual(sorted(item["state"] for item in self.verify(expect=0)["items"]), ["ok"] * 5)
        # And the repaired cache serves every kernel without compiling.
        result, stderr = self.prewarm(*FIVE_SPECS)
        self.assertEqual((result["compiled"], result["cached"]), (0, 5))
        self.assertEqual(warnings_in(stderr), [])

    def test_a_directory_holding_files_at_an_entry_path_is_set_aside_whole_and_never_pruned(self):
        # Adversarial pass, session 40: such a directory was listed as a damaged entry and
        # pruned with what it held. The cache never writes one: a call needing the entry moves
        # it out of the way with a warning, and nothing removes it.
        self.prewarm("--head-dim", "64")
        (entry,) = [item["path"] for item in self.items("ok")]
        os.unlink(entry)
        os.makedirs(os.path.join(entry, "sub"))
        write_bytes(os.path.join(entry, "sub", "notes.txt"), b"precious")
        self.assertEqual(self.verify(expect=0)["items"], [])
        result, stderr = self.prewarm("--head-dim", "64")
        self.assertEqual((result["compiled"], result["failed"]), (1, 0))
        (warning,) = warnings_in(stderr)
        self.assertIn("(a directory in place of the entry); set aside as", warning)
        moved = warning.split("set aside as '")[1].split("'")[0]
        self.assertEqual(read_bytes(os.path.join(moved, "sub", "notes.txt")), b"precious")
        self.assertEqual([item["state"] for item in self.verify(expect=0)["items"]], ["ok"])
        self.tool("--cache-dir", self.root, "prune")
        self.tool("--cache-dir", self.root, "prune", "--max-bytes", "1")
        self.assertEqual(read_bytes(os.path.join(moved, "sub", "notes.txt")), b"precious")


@needs_nvrtc
class UnusableDirectoryTest(CacheTestCase):
    def test_a_cache_root_under_a_regular_file_is_not_written_and_prewarm_fails_with_one_warning(self):
        blocker = os.path.join(self.scratch, "a_file")
        write_bytes(blocker, b"in the way")
        result, stderr = self.prewarm(*FIVE_SPECS, root=os.path.join(blocker, "cache"), expect=1)
        self.assertEqual((result["compiled"], result["failed"], result["written"]), (5, 0, 0))
        warnings = warnings_in(stderr)
        self.assertEqual(len(warnings), 1, stderr)
        self.assertIn("Not a directory", warnings[0])
        self.assertEqual(read_bytes(blocker), b"in the way")

    def test_rope_jit_quiet_silences_warnings_only_when_1_and_reports_a_value_it_cannot_read(self):
        blocker = os.path.join(self.scratch, "a_file")
        write_bytes(blocker, b"in the way")
        expected = {"1": [], "0": ["Not a directory"], "": ["Not a directory"],
                    "false": ["ROPE_JIT_QUIET: expected 0 or 1, got 'false'; warnings stay on",
                              "Not a directory"],
                    "yes": ["ROPE_JIT_QUIET: expected 0 or 1, got 'yes'; warnings stay on",
                            "Not a directory"]}
        for value, fragments in expected.items():
            result, stderr = self.prewarm("--head-dim", "64", root=os.path.join(blocker, "cache"), expect=1,
                                          extra_env={"ROPE_JIT_QUIET": value})
            self.assertEqual((result["compiled"], result["written"]), (1, 0), value)
            warnings = warnings_in(stderr)
            self.assertEqual(len(warnings), len(fragments), f"{value!r}: {stderr}")
            for warning, fragment in zip(warnings, fragments):
                self.assertIn(fragment, warning, value)

        # Several warnings in one process: a bad value is reported once, before the first.
        shared = os.path.join(self.scratch, "shared")
        os.makedirs(os.path.join(shared, "a"))
        os.makedirs(os.path.join(shared, "b"))
        os.chmod(shared, 0o777)  # writable by others, no sticky bit: both read-only roots unused
        env = {"ROPE_JIT_QUIET": "false",
               "ROPE_JIT_CACHE_RO_DIRS": os.path.join(shared, "a") + ":" + os.path.join(shared, "b")}
        result, stderr = self.prewarm("--head-dim", "64", root=os.path.join(blocker, "cache"), expect=1,
                                      extra_env=env)
        warnings = warnings_in(stderr)
        self.assertEqual(len(warnings), 4, stderr)
        self.assertIn("ROPE_JIT_QUIET: expected 0 or 1, got 'false'", warnings[0])
        self.assertEqual(sum("ROPE_JIT_QUIET" in warning for warning in warnings), 1, stderr)
        # Silenced, the summary does not point at a warning that was not printed.
        text = self.tool("--cache-dir", os.path.join(blocker, "cache"), "prewarm", "--target", "sm_90",
                         "--head-dim", "64", expect=1, extra_env={"ROPE_JIT_QUIET": "1"})
        self.assertEqual(warnings_in(text.stderr), [])
        self.assertIn("1 not written: kept in memory only, ROPE_JIT_QUIET=1 hid the warning saying why",
                      text.stdout)

    def test_a_write_limit_as_on_a_full_disk_makes_prewarm_compile_in_memory_with_one_warning(self):
        def limit_file_size():
            # Writes past the limit fail with EFBIG instead of killing the process.
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))

        result, stderr = self.prewarm(*FIVE_SPECS, preexec_fn=limit_file_size, expect=1)
        self.assertEqual((result["compiled"], result["failed"], result["written"]), (5, 0, 0))
        warnings = warnings_in(stderr)
        self.assertEqual(len(warnings), 1, stderr)
        self.assertIn("File too large", warnings[0])
        self.assertEqual(self.verify(expect=0)["items"], [], "a failed write left a file behind")

    def test_a_full_tmpfs_makes_prewarm_keep_the_rest_in_memory_with_one_warning(self):
        mount_point = os.path.join(self.scratch, "small")
        os.mkdir(mount_point)
        # Room for about two kernels of about 90 KiB each.
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k,mode=0700", "tmpfs", mount_point],
                                 capture_output=True)
        if mounted.returncode != 0:
            self.skipTest("cannot mount a tmpfs here (needs root); the write-limit test covers full disks")
        try:
            root = os.path.join(mount_point, "cache")
            result, stderr = self.prewarm(*FIVE_SPECS, root=root, expect=1)
            self.assertEqual((result["compiled"], result["failed"]), (5, 0))
            self.assertLess(result["written"], 5)
            warnings = warnings_in(stderr)
            self.assertEqual(len(warnings), 1, stderr)
            self.assertIn("No space left", warnings[0])
            report = self.verify(root=root, expect=0)
            self.assertEqual([item["state"] for item in report["items"]], ["ok"] * result["written"])
        finally:
            subprocess.run(["umount", mount_point], check=True)


@needs_nvrtc
class KilledWriterTest(CacheTestCase):
    def test_a_prewarm_killed_mid_write_leaves_nothing_that_loads_wrong_and_the_next_run_completes(self):
        caught_mid_write = 0
        for attempt in range(3):
            process = start_tool("--cache-dir", self.root, "prewarm", "--target", "sm_90", "--jobs", "2",
                                 *TWENTY_SPECS)
            deadline = time.monotonic() + 0.4 + 0.5 * attempt
            # Kill as soon as a temp file shows up (a write in flight), else at the deadline.
            while time.monotonic() < deadline and process.poll() is None:
                if any(name.startswith(".tmp-") for _, _, files in os.walk(self.root) for name in files):
                    caught_mid_write += 1
                    break
                time.sleep(0.0005)
            process.send_signal(signal.SIGKILL)
            process.communicate()
            report = self.verify(expect=0)
            states = {item["state"] for item in report["items"]}
            self.assertLessEqual(states, {"ok", "temp"}, report["items"])

        result, stderr = self.prewarm(*TWENTY_SPECS)
        self.assertEqual(result["failed"], 0)
        self.assertEqual(result["compiled"] + result["cached"], 20)
        self.assertEqual(warnings_in(stderr), [])
        self.assertEqual(len(self.items("ok")), 20)

        # Temp files a killed writer left are removed by prune once they are old enough.
        stale_time = time.time() - 3600
        for item in self.items("temp"):
            os.utime(item["path"], (stale_time, stale_time))
        self.tool("--cache-dir", self.root, "prune")
        self.assertEqual([item["state"] for item in self.verify(expect=0)["items"]], ["ok"] * 20)
        print(f"\n  killed writers caught with a temp file on disk: {caught_mid_write} of 3", file=sys.stderr)


@needs_nvrtc
class StaleEntryTest(CacheTestCase):
    def test_entries_of_another_format_nvrtc_version_or_build_are_ignored_and_prune_removes_them(self):
        self.prewarm("--head-dim", "64")
        (entry,) = self.items("ok")
        data = read_bytes(entry["path"])
        _, key, spec, payload = cache_entry_format.parse(data)
        relative = os.path.relpath(entry["path"], self.root)  # v1/nvrtc13.0/sm_90/xx/<key>.cubin
        parts = relative.split(os.sep)

        def plant(path, content):
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            write_bytes(path, content)

        other_nvrtc = os.path.join(self.root, "v1", "nvrtc11.8", *parts[2:])
        plant(other_nvrtc, data)
        other_format_dir = os.path.join(self.root, "v2")
        plant(os.path.join(other_format_dir, *parts[1:]), data)
        # What an older rope-jit (other templates) would have stored: another key, same spec.
        old_key = "ab" + key[2:] if not key.startswith("ab") else "cd" + key[2:]
        old_build = os.path.join(self.root, "v1", parts[1], parts[2], old_key[:2], old_key + ".cubin")
        plant(old_build, cache_entry_format.serialize(old_key, spec, payload))
        # A file of format 2 where format 1 files live cannot be read: damage.
        format_two = os.path.join(self.root, "v1", parts[1], parts[2], "ff", "f" * 64 + ".cubin")
        plant(format_two, cache_entry_format.serialize("f" * 64, spec, payload, format_version=2))
        os.unlink(entry["path"])

        report = self.verify(expect=1)
        by_path = {item["path"]: item for item in report["items"]}
        self.assertEqual(by_path[other_nvrtc]["state"], "stale")
        self.assertIn("NVRTC 11.8", by_path[other_nvrtc]["problem"])
        self.assertEqual(by_path[other_format_dir]["state"], "stale")
        self.assertIn("format v2", by_path[other_format_dir]["problem"])
        self.assertEqual(by_path[old_build]["state"], "stale")
        self.assertIn("another rope-jit build", by_path[old_build]["problem"])
        self.assertEqual(by_path[format_two]["state"], "damaged")
        self.assertIn("format version 2", by_path[format_two]["problem"])

        # None of them is loaded: the kernel compiles again.
        result, _ = self.prewarm("--head-dim", "64")
        self.assertEqual((result["compiled"], result["cached"]), (1, 0))

        kept = json.loads(self.tool("--cache-dir", self.root, "prune", "--keep-stale", "--json").stdout)
        self.assertEqual([item["path"] for item in kept["removed"]], [format_two])
        self.assertEqual(len(self.items("stale")), 3)
        # In text, a stale entry's line says why once (it said so twice: by its path, then as
        # the reason).
        text = self.tool("--cache-dir", self.root, "prune", "--dry-run").stdout
        line = next(line for line in text.splitlines() if old_build in line)
        self.assertTrue(line.startswith("would remove stale"), line)
        self.assertEqual(line.count("another rope-jit build"), 1, line)
        pruned = json.loads(self.tool("--cache-dir", self.root, "prune", "--json").stdout)
        self.assertEqual(sorted(item["path"] for item in pruned["removed"]),
                         sorted([other_nvrtc, other_format_dir, old_build]))
        self.assertEqual([item["state"] for item in self.verify(expect=0)["items"]], ["ok"])
        self.assertFalse(os.path.exists(other_format_dir))


@needs_nvrtc
class HostileRootTest(CacheTestCase):
    def test_cache_directories_are_created_private(self):
        self.prewarm("--head-dim", "64")
        (entry,) = self.items("ok")
        directory = os.path.dirname(entry["path"])
        while len(directory) >= len(self.root):
            self.assertEqual(stat.S_IMODE(os.stat(directory).st_mode) & 0o077, 0, directory)
            directory = os.path.dirname(directory)
        self.assertEqual(stat.S_IMODE(os.stat(entry["path"]).st_mode), 0o600)

    def test_a_root_others_can_write_is_not_written_even_with_the_sticky_bit(self):
        os.mkdir(self.root)
        for mode in (0o777, 0o1777, 0o770):
            os.chmod(self.root, mode)
            result, stderr = self.prewarm("--head-dim", "64", expect=1)
            self.assertEqual(result["written"], 0)
            warnings = warnings_in(stderr)
            self.assertEqual(len(warnings), 1, stderr)
            self.assertIn("can be written by other users", warnings[0])
            self.assertFalse(os.path.exists(os.path.join(self.root, "v1")))

        os.chmod(self.root, 0o700)
        result, stderr = self.prewarm("--head-dim", "64")
        self.assertEqual((result["written"], warnings_in(stderr)), (1, []))
        # verify's hint and prune's refusal say how to make the entry usable (verify said
        # "prune removes them", which prune then refused).
        os.chmod(self.root, 0o770)
        self.assertIn("chmod go-w", self.tool("--cache-dir", self.root, "verify", expect=1).stdout)
        self.assertIn("chmod go-w", self.tool("--cache-dir", self.root, "prune", expect=1).stderr)
        os.chmod(self.root, 0o700)

    @unittest.skipUnless(os.geteuid() == 0, "changing a directory's owner needs root")
    def test_a_root_owned_by_another_user_is_neither_written_nor_read(self):
        self.prewarm("--head-dim", "64")
        os.chown(self.root, 65534, 65534)
        result, stderr = self.prewarm("--head-dim", "64", expect=1)
        self.assertEqual((result["compiled"], result["cached"], result["written"]), (1, 0, 0))
        warnings = warnings_in(stderr)
        self.assertEqual(len(warnings), 1, stderr)
        self.assertIn("owned by uid 65534", warnings[0])
        info = json.loads(self.tool("--cache-dir", self.root, "info", "--json").stdout)
        self.assertFalse(info["cache_writable"])
        self.assertIn("owned by uid 65534", info["cache_problem"])
        # Nor does prune or clear remove anything there.
        self.tool("--cache-dir", self.root, "clear", expect=1)
        os.chown(self.root, os.geteuid(), os.getegid())
        self.assertEqual(len(self.items("ok")), 1)


@needs_nvrtc
class MaintenanceTest(CacheTestCase):
    def test_prune_removes_least_recently_used_entries_until_the_rest_fits(self):
        self.prewarm(*FIVE_SPECS)
        entries = sorted(self.items("ok"), key=lambda item: item["path"])
        now = time.time()
        for age, entry in enumerate(entries):  # entries[0] used most recently
            os.utime(entry["path"], (now - 3600 * (age + 1), now - 3600 * (age + 1)))
        budget = entries[0]["bytes"] + entries[1]["bytes"]
        pruned = json.loads(self.tool("--cache-dir", self.root, "prune", "--max-bytes", str(budget), "--json").stdout)
        self.assertEqual(sorted(item["path"] for item in pruned["removed"]),
                         sorted(entry["path"] for entry in entries[2:]))
        self.assertEqual(sorted(item["path"] for item in self.items("ok")),
                         sorted(entry["path"] for entry in entries[:2]))

        pruned = json.loads(self.tool("--cache-dir", self.root, "prune", "--older-than", "90m", "--json").stdout)
        self.assertEqual([item["path"] for item in pruned["removed"]], [entries[1]["path"]])

    def test_prewarm_says_how_many_entries_the_size_limit_removed_after_its_writes(self):
        # It said "4 written" where the limit had kept 1 (adversarial test, session 32).
        env = dict(tool_env(), ROPE_JIT_CACHE_MAX_BYTES="100K")
        args = [TOOL, "--cache-dir", self.root, "prewarm", "--target", "sm_90", "--jobs", "1",
                "--head-dim", "64,128", "--dtype", "f32,bf16"]
        result = subprocess.run(args + ["--json"], capture_output=True, text=True, env=env)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        report = json.loads(result.stdout)
        kept = len(self.items("ok"))
        self.assertEqual(report["written"], 4)
        self.assertGreater(report["evicted"], 0)
        self.assertEqual(report["evicted"], sum(kernel["evicted"] for kernel in report["kernels"]))
        self.assertEqual(kept, report["written"] - report["evicted"])
        self.tool("--cache-dir", self.root, "clear")
        result = subprocess.run(args, capture_output=True, text=True, env=env)
        self.assertIn("size limit (ROPE_JIT_CACHE_MAX_BYTES, else 1 GiB) removed", result.stdout)

    def test_prune_refuses_a_budget_of_zero_bytes_which_would_empty_the_cache(self):
        # ROPE_JIT_CACHE_MAX_BYTES=0 means no limit; passed to prune it removed every entry.
        self.prewarm("--head-dim", "64")
        result = self.tool("--cache-dir", self.root, "prune", "--max-bytes", "0", expect=2)
        self.assertIn("use `rope-jit-cache clear`", result.stderr)
        self.assertEqual(len(self.items("ok")), 1)

    def test_clear_removes_every_item_and_dry_runs_remove_nothing(self):
        self.prewarm(*FIVE_SPECS)
        temp = os.path.join(os.path.dirname(self.items("ok")[0]["path"]), ".tmp-1-2-3")
        write_bytes(temp, b"half")
        planned = json.loads(self.tool("--cache-dir", self.root, "clear", "--dry-run", "--json").stdout)
        self.assertEqual(len(planned["removed"]), 6)
        self.assertEqual(len(self.verify()["items"]), 6)
        self.tool("--cache-dir", self.root, "clear")
        self.assertEqual(self.verify(expect=0)["items"], [])
        self.assertTrue(os.path.isdir(self.root))
        # The compile lock files stay: empty, and perhaps held by a process compiling right now.
        self.assertEqual(sorted(os.listdir(self.root)), ["locks", "v1"])


class ConcurrentClearTest(CacheTestCase):
    def test_clears_of_one_cache_at_once_count_each_removal_once_between_them(self):
        # Each process counted every item it found gone as removed by itself: the totals of
        # two prunes at once added up to more than the cache held (left out in session 40).
        count, content = 1500, b"not a cache entry"
        for i in range(count):
            key = format(i * 0x9E3779B97F4A7C15 % (1 << 256), "064x")
            directory = os.path.join(self.root, "v1", "nvrtc13.0", "sm_90", key[:2])
            os.makedirs(directory, mode=0o700, exist_ok=True)
            write_bytes(os.path.join(directory, key + ".cubin"), content)
        for path, _, _ in os.walk(self.root):
            os.chmod(path, 0o700)
        processes = [start_tool("--cache-dir", self.root, "clear", "--json") for _ in range(4)]
        reports = []
        for process in processes:
            stdout, stderr = process.communicate(timeout=300)
            self.assertEqual(process.returncode, 0, stderr)
            reports.append(json.loads(stdout))
        removed = [len(report["removed"]) for report in reports]
        gone = [len(report["removed_by_another_process"]) for report in reports]
        self.assertEqual(sum(removed), count, (removed, gone))
        self.assertEqual(sum(report["removed_bytes"] for report in reports), count * len(content))
        self.assertEqual(sum(item["bytes"] for report in reports for item in report["removed"]),
                         count * len(content))
        self.assertEqual(self.verify(expect=0)["items"], [])


class PartialRemovalTest(CacheTestCase):
    def test_a_removal_that_fails_partway_counts_what_went_before_the_failure(self):
        # A tree whose removal failed partway counted 0 bytes (left out in session 43), so the
        # run's total missed what it had freed.
        top = os.path.join(self.root, "v3", "nvrtc9.9", "sm_90")
        freed, stuck = b"removable", b"stuck"
        paths = {}
        for prefix, content in (("aa", freed), ("ab", stuck)):
            os.makedirs(os.path.join(top, prefix))
            paths[prefix] = os.path.join(top, prefix, prefix + "0" * 62 + ".cubin")
            write_bytes(paths[prefix], content)
        blocked = os.path.dirname(paths["ab"])
        as_other_user = None
        if os.geteuid() == 0:
            # Root may write into any directory: the tool runs as another user, who owns all
            # but the blocked directory.
            for path, _, names in os.walk(self.scratch):
                for item in [path] + [os.path.join(path, name) for name in names]:
                    os.chown(item, OTHER_UID, OTHER_UID)
            os.chown(blocked, 0, 0)
            os.chmod(blocked, 0o755)

            def as_other_user():
                os.setgid(OTHER_UID)
                os.setuid(OTHER_UID)
        else:
            os.chmod(blocked, 0o555)

        def clear(*args):
            return self.tool("--cache-dir", self.root, "clear", *args, expect=1,
                             preexec_fn=as_other_user)

        text = clear()
        self.assertIn(f"cannot remove '{blocked}/", text.stderr)
        self.assertIn("of it removed before that", text.stderr)
        self.assertFalse(os.path.exists(paths["aa"]))
        self.assertEqual(read_bytes(paths["ab"]), stuck)

        # Again with the first directory back: the JSON report counts its file in the failure
        # and in the run's total.
        os.makedirs(os.path.dirname(paths["aa"]), exist_ok=True)
        write_bytes(paths["aa"], freed)
        if as_other_user is not None:
            os.chown(os.path.dirname(paths["aa"]), OTHER_UID, OTHER_UID)
            os.chown(paths["aa"], OTHER_UID, OTHER_UID)
        report = json.loads(clear("--json").stdout)
        (failure,) = report["failures"]
        self.assertEqual(failure["path"], os.path.join(self.root, "v3"))
        self.assertIn("cannot remove", failure["error"])
        self.assertEqual(failure["removed_bytes"], len(freed))
        self.assertEqual(report["removed_bytes"], len(freed))
        self.assertEqual(report["removed"], [])
        self.assertEqual(report["remaining"]["bytes"], len(stuck))  # what is left of the tree
        self.assertFalse(os.path.exists(paths["aa"]))
        self.assertEqual(read_bytes(paths["ab"]), stuck)


@needs_nvrtc
class NvrtcMemoTest(CacheTestCase):
    def test_the_nvrtc_identity_memo_in_the_default_root_is_no_cache_item_and_clear_keeps_it(self):
        # The memo lives in the default root (ROPE_JIT_CACHE_DIR here), written when NVRTC loads.
        env = dict(tool_env(), ROPE_JIT_CACHE_DIR=self.root)
        result = subprocess.run([TOOL, "prewarm", "--target", "sm_90", "--head-dim", "64"],
                                capture_output=True, text=True, env=env)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        memo = os.path.join(self.root, "nvrtc-identity.json")
        with open(memo) as file:
            self.assertEqual(json.load(file)["version"], json.loads(self.tool("info", "--json").stdout)["nvrtc_version"])
        items = self.verify(expect=0)["items"]
        self.assertTrue(items)
        self.assertNotIn(memo, [item["path"] for item in items])
        self.tool("--cache-dir", self.root, "clear")
        self.assertEqual(self.verify(expect=0)["items"], [])
        self.assertEqual(sorted(os.listdir(self.root)), ["locks", "nvrtc-identity.json", "v1"])

    def test_a_fifo_in_place_of_the_memo_blocks_no_process_and_the_next_load_replaces_it(self):
        # Opened blocking, a FIFO there hung every process that asked for NVRTC's identity
        # (adversarial test, session 32).
        os.makedirs(self.root, mode=0o700)
        memo = os.path.join(self.root, "nvrtc-identity.json")
        os.mkfifo(memo, 0o600)
        env = dict(tool_env(), ROPE_JIT_CACHE_DIR=self.root)
        result = subprocess.run([TOOL, "prewarm", "--target", "sm_90", "--head-dim", "64"],
                                capture_output=True, text=True, env=env, timeout=120)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertTrue(os.path.isfile(memo))


class CommandLineTest(CacheTestCase):
    def test_help_exits_0_and_usage_errors_exit_2_for_every_subcommand(self):
        for subcommand in ("prewarm", "list", "verify", "prune", "clear", "info"):
            result = self.tool(subcommand, "--help")
            self.assertIn("Usage", result.stdout, subcommand)
            self.assertIn("--json", result.stdout + self.tool("--help").stdout)
            self.tool(subcommand, "--no-such-option", expect=2)
        self.tool(expect=2)
        self.tool("no-such-subcommand", expect=2)
        self.tool("prewarm", expect=2)  # nothing to compile
        self.tool("prewarm", "--preset", "no-such-model", expect=2)
        self.tool("prewarm", "--head-dim", "64", "--style", "diagonal", expect=2)
        self.tool("prewarm", "--dtype", "bf16", expect=2)  # spec flags without --head-dim
        self.tool("prewarm", "--head-dim", "64", "--target", "volta", expect=2)
        self.tool("prune", "--max-bytes", "lots", expect=2)
        # --max-bytes reads sizes as ROPE_JIT_CACHE_MAX_BYTES does (2GB was refused by one only).
        for value in ("2GB", "2GiB", "3k", "512B"):
            self.tool("--cache-dir", self.root, "prune", "--max-bytes", value, "--dry-run")
        for value in ("2g", "5iB", "2GBB"):
            result = self.tool("--cache-dir", self.root, "prune", "--max-bytes", value, expect=2)
            self.assertIn("unknown unit", result.stderr)
        self.tool("prune", "--older-than", "3 fortnights", expect=2)
        # Numbers past 64 bits would wrap to a tiny budget or age, and prune would then empty
        # the cache; an empty --cache-dir would quietly mean the default cache.
        for option, value in (("--max-bytes", "16777216T"), ("--max-bytes", "17179869184G"),
                              ("--older-than", "20000000000000w"), ("--older-than", "999999999999999d")):
            result = self.tool("--cache-dir", self.root, "prune", option, value, expect=2)
            self.assertIn("too large", result.stderr)
        # Leading zeros are not size; 2^64 - 1 bytes is a limit, 2^64 is not.
        for value in ("00000000000000000000001", "18446744073709551615", "16777215T"):
            self.tool("--cache-dir", self.root, "prune", "--max-bytes", value, "--dry-run")
        result = self.tool("--cache-dir", self.root, "prune", "--max-bytes", "18446744073709551616", expect=2)
        self.assertIn("'18446744073709551616' is too large (over 2^64 - 1 bytes)", result.stderr)
        # An empty limit (an unset shell variable) is no limit the user meant.
        for option in ("--max-bytes", "--older-than"):
            result = self.tool("--cache-dir", self.root, "prune", option, "", expect=2)
            self.assertIn("empty", result.stderr, option)
        for subcommand in ("clear", "prune", "verify"):
            result = self.tool("--cache-dir", "", subcommand, expect=2)
            self.assertIn("empty", result.stderr)

    def test_a_root_that_is_a_file_fails_and_a_missing_one_is_empty(self):
        write_bytes(self.root, b"not a directory")
        for subcommand in ("list", "verify", "prune", "clear"):
            result = self.tool("--cache-dir", self.root, subcommand, expect=1)
            self.assertIn("not a directory", result.stderr, subcommand)
        self.assertEqual(read_bytes(self.root), b"not a directory")
        self.assertEqual(self.verify(root=os.path.join(self.scratch, "missing"), expect=0)["items"], [])
        # Looking creates nothing (info made the missing root and its v1: a mistyped path left
        # directories behind), nor does pruning a root that holds another format's tree alone.
        missing = os.path.join(self.scratch, "missing", "deep")
        info = json.loads(self.tool("--cache-dir", missing, "info", "--json").stdout)
        self.assertEqual((info["cache_exists"], info["cache_writable"]), (False, False))
        self.assertIn("does not exist yet", info["cache_problem"])
        for subcommand in ("list", "verify", "prune", "clear"):
            self.tool("--cache-dir", missing, subcommand)
        self.assertFalse(os.path.exists(os.path.join(self.scratch, "missing")))
        other_format = os.path.join(self.scratch, "v2only")
        os.makedirs(os.path.join(other_format, "v2", "nvrtc12.0"), mode=0o700)
        os.chmod(other_format, 0o700)
        self.tool("--cache-dir", other_format, "prune")
        self.assertEqual(os.listdir(other_format), [])

    def test_prune_leaves_v_directories_that_are_not_the_caches(self):
        project = os.path.join(self.root, "v2", "src", "main.c")
        os.makedirs(os.path.dirname(project))
        write_bytes(project, b"int main() {}")
        other_format = os.path.join(self.root, "v3", "nvrtc12.0")
        os.makedirs(other_format)
        pruned = json.loads(self.tool("--cache-dir", self.root, "prune", "--json").stdout)
        self.assertEqual([item["path"] for item in pruned["removed"]], [os.path.dirname(other_format)])
        self.assertEqual(read_bytes(project), b"int main() {}")

    def test_json_reports_survive_file_names_that_are_not_utf8(self):
        # The cache's own names are ASCII; a root's name need not be UTF-8.
        root = self.scratch.encode() + b"/cache\xff\xfe"
        odd = root + b"/v1/nvrtc13.0/sm_90/ab/ab" + b"0" * 62 + b".cubin"
        os.makedirs(os.path.dirname(odd), mode=0o700)
        os.chmod(root, 0o700)
        write_bytes(odd, b"x")
        result = subprocess.run([TOOL.encode(), b"--cache-dir", root, b"list", b"--json"], capture_output=True,
                                env=tool_env())
        self.assertEqual(result.returncode, 0, result.stderr)
        listed = json.loads(result.stdout)
        self.assertEqual([item["state"] for item in listed["items"]], ["damaged"])
        self.assertIn("\ufffd", listed["items"][0]["path"])
        result = subprocess.run([TOOL.encode(), b"--cache-dir", root, b"prune", b"--json"], capture_output=True,
                                env=tool_env())
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(len(json.loads(result.stdout)["removed"]), 1)
        self.assertFalse(os.path.exists(odd))

    @unittest.skipIf(os.geteuid() == 0, "root lists any directory")
    def test_a_directory_that_cannot_be_listed_fails_verify_and_clear(self):
        hidden = os.path.join(self.root, "v1", "nvrtc13.0", "sm_90", "ab")
        os.makedirs(hidden)
        write_bytes(os.path.join(hidden, "ab" + "0" * 62 + ".cubin"), b"damaged")
        os.chmod(hidden, 0)
        report = self.verify(expect=1)
        self.assertEqual([(item["path"], item["state"]) for item in report["items"]], [(hidden, "stray")])
        self.assertIn("cannot list", report["items"][0]["problem"])
        # Its times need no listing (they were 0, the epoch: adversarial pass, session 40).
        self.assertEqual(report["items"][0]["modified"], int(os.lstat(hidden).st_mtime))
        # It cannot empty what it cannot list, and says so (it called the directory foreign).
        result = self.tool("--cache-dir", self.root, "clear", expect=1)
        self.assertIn(f"cannot remove '{hidden}': cannot list it: Permission denied", result.stderr)
        os.chmod(hidden, 0o700)
        self.assertEqual([item["state"] for item in self.verify(expect=1)["items"]], ["damaged"])

    def test_every_subcommand_prints_one_json_document_with_json(self):
        for subcommand in (["list"], ["verify"], ["prune"], ["clear"], ["info"],
                           ["prewarm", "--dry-run", "--preset", "llama3-8b", "--target", "sm_90"]):
            result = self.tool("--cache-dir", self.root, *subcommand, "--json")
            self.assertIsInstance(json.loads(result.stdout), dict, subcommand)
        # Also when the run fails (a root that is a file) or is refused: list, verify, prune
        # and clear printed nothing on stdout (adversarial pass, session 49).
        root_file = os.path.join(self.scratch, "a-file")
        write_bytes(root_file, b"x")
        for subcommand in ("list", "verify", "prune", "clear"):
            result = self.tool("--cache-dir", root_file, subcommand, "--json", expect=1)
            document = json.loads(result.stdout)
            self.assertEqual((document["command"], document["exit_code"]), (subcommand, 1))
            self.assertIn("is not a directory", document["error"])
            self.assertIn(document["error"], result.stderr)
        result = self.tool("--cache-dir", self.root, "prewarm", "--json", "--head-dim", "63", "--target", "sm_90",
                           expect=2)
        self.assertEqual(json.loads(result.stdout), {"command": "prewarm", "exit_code": 2,
                                                     "error": "flags: kernel spec: head_dim must be even, got 63"})
        # Command lines CLI11 refuses, and an unknown subcommand (review, session 49).
        for args, command, error in [(["prune", "--json", "--max-bytes="], "prune", "--max-bytes"),
                                     (["list", "--json", "--bogus"], "list", "--bogus"),
                                     (["--json", "lisst"], "", "unknown subcommand 'lisst'")]:
            result = self.tool("--cache-dir", self.root, *args, expect=2)
            document = json.loads(result.stdout)
            self.assertEqual((document["command"], document["exit_code"]), (command, 2), args)
            self.assertIn(error, document["error"], args)
        self.assertEqual(self.tool("--cache-dir", self.root, "list", "--json", "--help").stdout.count("{"), 0)

    def test_presets_use_each_models_head_dim_rotary_dim_style_and_gqa_group(self):
        # From each model's config.json: hidden size, attention heads, kv heads, the rotary
        # fraction (partial_rotary_factor, rotary_pct, or rotary_dim / head_dim) and the pair
        # style (GPT-J rotates interleaved pairs, the others rotate halves).
        models = {
            "llama3-8b": (4096, 32, 8, 1.0, "half"),
            "llama3-70b": (8192, 64, 8, 1.0, "half"),
            "mistral-7b": (4096, 32, 8, 1.0, "half"),
            "qwen2.5-7b": (3584, 28, 4, 1.0, "half"),
            "gemma-2-9b": (16 * 256, 16, 8, 1.0, "half"),  # head_dim 256 set explicitly in its config
            "phi-3-mini": (3072, 32, 32, 1.0, "half"),
            "phi-4-mini": (3072, 24, 8, 0.75, "half"),
            "phi-2": (2560, 32, 32, 0.4, "half"),
            "gpt-j-6b": (4096, 16, 16, 64 / 256, "interleaved"),
            "gpt-neox-20b": (6144, 64, 64, 0.25, "half"),
        }
        for name, (hidden, heads, kv_heads, fraction, style) in models.items():
            plan = json.loads(self.tool("--cache-dir", self.root, "prewarm", "--dry-run", "--json", "--preset", name,
                                        "--target", "sm_90").stdout)
            head_dim = hidden // heads
            specs = [kernel["spec"] for kernel in plan["kernels"]]
            for spec in specs:
                self.assertEqual(spec["head_dim"], head_dim, name)
                self.assertEqual(spec["rotary_dim"], int(head_dim * fraction), name)
                self.assertEqual(spec["style"], style, name)
                self.assertEqual(spec["gqa_group"], heads // kv_heads, name)
                self.assertEqual((spec["dtype"], spec["table_dtype"]), ("bfloat16", "bfloat16"), name)
            rope = [spec for spec in specs if spec["op"] == "rope"]
            # rope_jit.rope in place, apply_rope and the HF drop-in out of place (forward and
            # the backward of autograd), with implicit positions, indices and per-sequence
            # offsets (the HF drop-in with a batch of [B, S, R] tables); HF-style full tables.
            # And calls on dense rows in prefill (dense_rows: the flat path's kernel;
            # rope_jit.rope's C-contiguous [B, H, S, D] q and k, or 16-bit [B, S, H, D] ones
            # rotated whole), where the plan has that path (out-of-place partial rotary only with
            # interleaved pairs, GPT-J's: the others' specs merge with the plain ones).
            flat = name not in ("phi-2", "gpt-neox-20b", "phi-4-mini")
            expected = [(direction, positions, in_place, False) for direction in ("forward", "backward")
                        for positions in ("implicit", "indices", "seqlen-offsets") for in_place in (True, False)]
            expected += [(direction, positions, in_place, True) for direction in ("forward", "backward")
                         for positions in ("implicit", "indices", "seqlen-offsets") for in_place in (True, False)
                         if flat or in_place]
            self.assertEqual(sorted((spec["direction"], spec["positions"], spec["in_place_q"], spec["dense_rows"])
                                    for spec in rope), sorted(expected), name)
            self.assertTrue(all(spec["angles"] == "table-full" and spec["has_k"] for spec in rope), name)
            attention = [spec for spec in specs if spec["op"] == "attention"]
            kinds = sorted({spec["kind"] for spec in attention})
            # The backward on sm_90: the wgmma kernels (prepare, backward, dq finish) where
            # tensor cores take the rotation and head_dim pads to 64, 128 or 256; else dq and
            # dk/dv.
            rotary = int(head_dim * fraction)
            wgmma_backward = (head_dim % 8 == 0 and (head_dim + 15) // 16 * 16 in (64, 128, 256)
                              and rotary % (8 if style == "interleaved" else 16) == 0)
            self.assertEqual(kinds, ["backward-dq-finish", "backward-prepare", "backward-wgmma", "forward"]
                             if wgmma_backward else ["backward-dkdv", "backward-dq", "forward"], name)
            for table_full in (False, True):
                forwards = [spec for spec in attention
                            if spec["kind"] == "forward" and spec["table_full"] == table_full]
                self.assertEqual(sorted(spec["write_lse"] for spec in forwards), [False, True], name)
            self.assertTrue(all(spec["causal"] for spec in attention), name)
            only_rope = json.loads(self.tool("--cache-dir", self.root, "prewarm", "--dry-run", "--json", "--preset",
                                             name, "--ops", "rope", "--target", "sm_90").stdout)
            self.assertEqual([kernel["spec"] for kernel in only_rope["kernels"]], rope, name)
        self.tool("prewarm", "--preset", "llama3-8b", "--ops", "conv", "--target", "sm_90", expect=2)

    def test_the_gemma_4_preset_prewarms_proportional_rope_kernels_only(self):
        # Proportional partial rotary over a quarter of head_dim 512 (issue 23); the attention
        # op has no proportional pairs, so --ops attention alone has nothing to compile.
        plan = json.loads(self.tool("--cache-dir", self.root, "prewarm", "--dry-run", "--json", "--preset",
                                    "gemma-4", "--target", "sm_90").stdout)
        specs = [kernel["spec"] for kernel in plan["kernels"]]
        self.assertEqual(len(specs), 12 + 6)  # and dense_rows in place (forward, backward) x 3 positions
        for spec in specs:
            self.assertEqual((spec["op"], spec["style"], spec["head_dim"], spec["rotary_dim"], spec["gqa_group"]),
                             ("rope", "proportional", 512, 128, 2))
            self.assertEqual(spec["rotary_offset"], 0)
        result = self.tool("--cache-dir", self.root, "prewarm", "--json", "--preset", "gemma-4", "--target", "sm_90")
        self.assertEqual(len(json.loads(result.stdout)["kernels"]), 18)
        listed = json.loads(self.tool("--cache-dir", self.root, "list", "--json").stdout)["items"]
        self.assertEqual(sorted(item["spec_json"]["style"] for item in listed), ["proportional"] * 18)
        self.tool("prewarm", "--dry-run", "--preset", "gemma-4", "--ops", "attention", "--target", "sm_90",
                  expect=2)
        self.tool("--cache-dir", self.root, "prewarm", "--dry-run", "--head-dim", "64", "--rotary-dim", "16",
                  "--style", "proportional", "--target", "sm_90")

    def test_dense_rows_specs_from_flags_and_their_limits(self):
        # --dense-rows: the kernel of calls on dense rows (the flat path's); with a positions
        # tensor too; not packed, which the spec check refuses naming the field.
        plan = json.loads(self.tool("--cache-dir", self.root, "prewarm", "--dry-run", "--json", "--head-dim", "64",
                                    "--dense-rows", "--target", "sm_90").stdout)
        self.assertEqual([kernel["spec"]["dense_rows"] for kernel in plan["kernels"]], [True])
        plain = json.loads(self.tool("--cache-dir", self.root, "prewarm", "--dry-run", "--json", "--head-dim", "64",
                                     "--target", "sm_90").stdout)
        self.assertEqual([kernel["spec"]["dense_rows"] for kernel in plain["kernels"]], [False])
        positions = json.loads(self.tool("--cache-dir", self.root, "prewarm", "--dry-run", "--json", "--head-dim",
                                         "64", "--dense-rows", "--positions", "indices", "--target", "sm_90").stdout)
        self.assertEqual([(kernel["spec"]["dense_rows"], kernel["spec"]["positions"])
                          for kernel in positions["kernels"]], [(True, "indices")])
        refused = self.tool("--cache-dir", self.root, "prewarm", "--dry-run", "--head-dim", "64", "--dense-rows",
                            "--packed", "--target", "sm_90", expect=2)
        self.assertIn("dense_rows", refused.stderr)

    def test_the_qwen3_8b_preset_prewarms_rope_kernels_with_qk_norm(self):
        # head_dim 128, 32/8 heads, q_norm/k_norm over the head before the rotation: forwards,
        # and backwards with the weight gradients; attention as for the other models.
        plan = json.loads(self.tool("--cache-dir", self.root, "prewarm", "--dry-run", "--json", "--preset",
                                    "qwen3-8b", "--target", "sm_90").stdout)
        specs = [kernel["spec"] for kernel in plan["kernels"]]
        # The inference kernels with a paged KV cache write (bf16 and FP8), then the rest.
        cached = [spec for spec in specs if spec["op"] == "rope" and spec["kv_cache"] != "none"]
        self.assertEqual(sorted(spec["kv_fp8"] for spec in cached), [False, True])
        for spec in cached:
            self.assertEqual((spec["kv_cache"], spec["v_head_dim"], spec["qk_norm"], spec["direction"]),
                             ("slot-mapping", 128, True, "forward"))
        rope = [spec for spec in specs if spec["op"] == "rope" and spec["kv_cache"] == "none"]
        self.assertEqual(len(rope), 12)
        for spec in rope:
            self.assertEqual((spec["head_dim"], spec["gqa_group"], spec["qk_norm"], spec["norm_weight_dtype"]),
                             (128, 4, True, "bfloat16"))
            self.assertEqual(spec["norm_weight_grad"], spec["direction"] == "backward")
        self.assertTrue(any(spec["op"] == "attention" for spec in specs))
        result = self.tool("--cache-dir", self.root, "prewarm", "--json", "--preset", "qwen3-8b", "--ops", "rope",
                           "--target", "sm_90")
        self.assertEqual(json.loads(result.stdout)["compiled"], 14)

    def test_a_manifest_expands_each_spec_as_the_cross_product_of_its_lists_and_merges_duplicates(self):
        manifest = os.path.join(self.scratch, "manifest.json")
        write_bytes(manifest, json.dumps({
            "presets": ["llama3-8b", "mistral-7b"], "ops": ["rope"],
            "specs": [{"head_dim": [64, 128], "style": ["half", "interleaved"], "dtype": "float16"}]}).encode())
        plan = json.loads(self.tool("--cache-dir", self.root, "prewarm", "--dry-run", "--json", "--manifest", manifest,
                                    "--target", "sm_80,sm_90").stdout)
        # llama3-8b and mistral-7b share their 24 specs (12, and 12 dense_rows)
        self.assertEqual(len(plan["kernels"]), 2 * (24 + 4))
        merged = [kernel for kernel in plan["kernels"] if "mistral-7b" in kernel["sources"]]
        self.assertEqual(len(merged), 2 * 24)
        self.assertTrue(all(kernel["sources"] == ["llama3-8b", "mistral-7b"] for kernel in merged))
        for bad in ({"specs": [{"head_dim": 64, "colour": "blue"}]}, {"specs": [{"head_dim": 64, "style": []}]},
                    {"specs": [{"head_dim": 64}], "extra": 1}, {"presets": ["no-such-model"]}, {"specs": []}):
            write_bytes(manifest, json.dumps(bad).encode())
            self.tool("prewarm", "--manifest", manifest, "--target", "sm_90", expect=2)
        write_bytes(manifest, b"{not json")
        self.tool("prewarm", "--manifest", manifest, expect=2)
        self.tool("prewarm", "--manifest", os.path.join(self.scratch, "missing.json"), expect=2)

    def test_manifest_values_the_library_refuses_are_usage_errors_naming_the_field(self):
        # Issue 20 C3 (these exited 1) and D2 (this one exited 0 and wrote an entry after a
        # signed overflow in the spec's validation).
        manifest = os.path.join(self.scratch, "manifest.json")
        for spec, message in (({"head_dim": -2}, "head_dim: must be in"), ({"head_dim": 63}, "head_dim must be even"),
                              ({"head_dim": 64, "dtype": "float8"}, "dtype: expected one of"),
                              ({"op": "attention", "head_dim": 2000}, "head_dim: must be in"),
                              ({"op": "conv", "head_dim": 64}, "op: expected")):
            write_bytes(manifest, json.dumps([spec]).encode())
            result = self.tool("--cache-dir", self.root, "prewarm", "--manifest", manifest, "--target", "sm_90",
                               expect=2)
            self.assertIn(message, result.stderr, spec)
        result = self.tool("--cache-dir", self.root, "prewarm", "--head-dim", "128", "--rotary-dim", "2",
                           "--rotary-offset", "2147483646", "--target", "sm_90", expect=2)
        self.assertIn("rotary_offset", result.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.root, "v1")))

    def test_targets_that_are_not_architectures_are_usage_errors(self):
        # Issue 20 C3: these passed the old pattern and exited 1 from the library.
        for target in ("sm_9", "sm_90x", "sm_0", "sm_" + "1" * 20, "compute_", "sm_090"):
            result = self.tool("--cache-dir", self.root, "prewarm", "--head-dim", "64", "--target", target, expect=2)
            self.assertIn("--target", result.stderr, target)
        self.tool("--cache-dir", self.root, "prewarm", "--dry-run", "--head-dim", "64", "--target", "sm_90a,sm_100")

    def test_manifests_are_bounded_in_depth_size_and_specs(self):
        manifest = os.path.join(self.scratch, "manifest.json")
        # Issue 20 C1: a deeply nested manifest crashed the tool (stack overflow).
        write_bytes(manifest, b"[" * 100000 + b"]" * 100000)
        result = self.tool("prewarm", "--manifest", manifest, "--target", "sm_90", expect=2)
        self.assertIn("nests deeper", result.stderr)
        # Issue 20 C2: /dev/zero grew to gigabytes; a large file is refused unread (read to the
        # end it never returns: the timeout fails the test).
        result = self.tool("prewarm", "--manifest", "/dev/zero", "--target", "sm_90", expect=2, timeout=60)
        self.assertIn("larger than", result.stderr)
        write_bytes(manifest, b"[" + b" " * (5 << 20) + b"]")
        self.tool("prewarm", "--manifest", manifest, "--target", "sm_90", expect=2)
        # A few bytes of lists must not stand for billions of specs.
        write_bytes(manifest, json.dumps([{"head_dim": list(range(2, 200, 2)), "gqa_group": list(range(1, 100)),
                                           "rotary_offset": list(range(0, 100, 2))}]).encode())
        result = self.tool("prewarm", "--dry-run", "--manifest", manifest, "--target", "sm_90", expect=2)
        self.assertIn("more than the 20000 specs", result.stderr)
        # Specs without lists count too (adversarial pass, session 38): 20001 of them passed,
        # and the budget, wrapped below zero, then let any list through.
        write_bytes(manifest, json.dumps([{"head_dim": 2 * (i + 1)} for i in range(20001)]).encode())
        result = self.tool("prewarm", "--dry-run", "--manifest", manifest, "--target", "sm_90", expect=2,
                           timeout=120)
        self.assertIn("past the 20000 specs", result.stderr)
        bomb = [{"head_dim": 2}] * 20001 + [{"head_dim": list(range(2, 4002, 2)),
                                             "gqa_group": list(range(1, 1000))}]
        write_bytes(manifest, json.dumps(bomb).encode())
        result = self.tool("prewarm", "--dry-run", "--manifest", manifest, "--target", "sm_90", expect=2,
                           timeout=120)
        self.assertIn("20000 specs", result.stderr)
        # 600000 empty objects in 1.8 MB: parsed in time linear in the text, and refused as
        # too many specs. The duplicate-key check's parse callback rescanned the array at each
        # object's end (session 45): 28 s for 320000 at -O2, minutes for 4 MB.
        write_bytes(manifest, b"[" + b",".join([b"{}"] * 600000) + b"]")
        result = self.tool("prewarm", "--dry-run", "--manifest", manifest, "--target", "sm_90", expect=2,
                           timeout=30)
        self.assertIn("past the 20000 specs", result.stderr)
        # A key given twice: nlohmann kept the last value, silently.
        write_bytes(manifest, b'[{"op": "rope", "head_dim": 128, "head_dim": 64}]')
        result = self.tool("prewarm", "--dry-run", "--manifest", manifest, "--target", "sm_90", expect=2)
        self.assertIn("key 'head_dim' given twice", result.stderr)
        # Duplicates merge by hash: 3600 specs, each twice, one kernel each with both sources.
        # (How fast is a benchmark's question, not a test's: a 2-core machine under load took
        # 7 s; the timeout only catches a hang.)
        many = {"head_dim": 128, "rotary_dim": 2, "rotary_offset": list(range(0, 120, 2)),
                "gqa_group": list(range(1, 61))}
        write_bytes(manifest, json.dumps([many, many]).encode())
        plan = json.loads(self.tool("--cache-dir", self.root, "prewarm", "--dry-run", "--json", "--manifest",
                                    manifest, "--target", "sm_90", timeout=120).stdout)
        self.assertEqual(len(plan["kernels"]), 3600)
        self.assertEqual({len(kernel["sources"]) for kernel in plan["kernels"]}, {2})

    def test_manifests_are_bounded_in_memory_and_targets_and_a_fifo_blocks_nothing(self):
        # Adversarial pass, session 45. Each of these took gigabytes before the budget on
        # specs was reached; under 512 MiB of data they failed with bad_alloc.
        def small_memory():
            if b"__asan_init" not in read_bytes(TOOL):  # ASan reserves terabytes up front
                resource.setrlimit(resource.RLIMIT_DATA, (512 << 20, 512 << 20))

        manifest = os.path.join(self.scratch, "manifest.json")
        # An 80 KB value beside a list of 20000: copied into every spec at once, 1.6 GB.
        write_bytes(manifest, json.dumps([{"head_dim": 64, "rotary_offset": list(range(0, 40000, 2)),
                                           "zz": "x" * 80000}]).encode())
        result = self.tool("prewarm", "--dry-run", "--manifest", manifest, "--target", "sm_90", expect=2,
                           preexec_fn=small_memory, timeout=60)
        self.assertIn("#0 (spec 0): unknown field 'zz'", result.stderr)
        # 400000 preset names in 3.6 MB, each expanded before the budget applied: 2.4 GB.
        write_bytes(manifest, json.dumps({"presets": ["phi-2"] * 400000}).encode())
        result = self.tool("prewarm", "--dry-run", "--manifest", manifest, "--target", "sm_90", expect=2,
                           preexec_fn=small_memory, timeout=60)
        self.assertIn("past the 20000 specs", result.stderr)
        # The budget counts a spec once per target: 10000 specs fit two targets, not three.
        write_bytes(manifest, json.dumps([{"head_dim": list(range(2, 402, 2)),
                                           "gqa_group": list(range(1, 51))}]).encode())
        plan = json.loads(self.tool("--cache-dir", self.root, "prewarm", "--dry-run", "--json", "--manifest",
                                    manifest, "--target", "sm_90", "--target", "sm_80", timeout=120).stdout)
        self.assertEqual(len(plan["kernels"]), 20000)
        result = self.tool("prewarm", "--dry-run", "--manifest", manifest, "--target", "sm_90", "--target", "sm_80",
                           "--target", "sm_86", expect=2)
        self.assertIn("its lists stand for more than the 20000 specs one run may prewarm, each counted for its 3 "
                      "targets", result.stderr)
        # A FIFO no process writes blocked the tool in open() for ever: now it waits 10 s for
        # data, and reads what a writer that opens it later writes.
        fifo = os.path.join(self.scratch, "fifo")
        os.mkfifo(fifo)
        start = time.monotonic()
        result = self.tool("prewarm", "--dry-run", "--manifest", fifo, "--target", "sm_90", expect=2, timeout=60)
        self.assertIn("nothing written to it for 10 s", result.stderr)
        self.assertGreater(time.monotonic() - start, 9.0)
        process = start_tool("--cache-dir", self.root, "prewarm", "--dry-run", "--json", "--manifest", fifo,
                             "--target", "sm_90")
        time.sleep(0.5)
        with open(fifo, "w") as writer:
            writer.write(json.dumps([{"head_dim": 64}]))
        stdout, stderr = process.communicate(timeout=60)
        self.assertEqual(process.returncode, 0, stderr)
        self.assertEqual(len(json.loads(stdout)["kernels"]), 1)
        result = self.tool("prewarm", "--dry-run", "--manifest", self.scratch, "--target", "sm_90", expect=2)
        self.assertIn("is a directory", result.stderr)

    @needs_nvrtc
    def test_list_json_is_a_manifest_that_prewarms_the_same_entries_into_an_empty_root(self):
        manifest = os.path.join(self.scratch, "manifest.json")
        write_bytes(manifest, json.dumps({"specs": [
            {"head_dim": 64, "dtype": "bfloat16", "direction": ["forward", "backward"], "in_place_q": [True, False]},
            {"head_dim": 96, "rotary_dim": 24, "in_place_q": False, "positions": "indices", "style": "interleaved"},
            {"head_dim": 64, "angles": "inv-freq", "direction": "backward", "freq_grad": True, "has_k": False},
            {"op": "attention", "head_dim": 32, "rotary_dim": 16, "direction": ["forward", "backward"]},
        ]}).encode())
        first, _ = self.prewarm("--manifest", manifest)
        self.assertEqual(first["failed"], 0)
        listed = self.tool("--cache-dir", self.root, "list", "--json").stdout
        write_bytes(manifest, listed.encode())
        other = os.path.join(self.scratch, "other")
        second = json.loads(self.tool("--cache-dir", other, "prewarm", "--json", "--manifest", manifest).stdout)
        self.assertEqual(second["failed"], 0)
        self.assertEqual(second["compiled"], len(json.loads(listed)["items"]))

        def entries(root):
            items = json.loads(self.tool("--cache-dir", root, "list", "--json").stdout)["items"]
            self.assertTrue(all(item["state"] == "ok" for item in items))
            return sorted((item["target"], item["key"], json.dumps(item["spec_json"], sort_keys=True),
                           item["payload_bytes"]) for item in items)
        self.assertEqual(entries(other), entries(self.root))
        # The listed specs, as plain spec objects, are a manifest too (the one-liner in the
        # README: jq '[.items[] | select(.state == "ok") | .spec_json]').
        # --target applies to a listed manifest's items too (it was ignored, and not checked).
        write_bytes(manifest, listed.encode())
        retargeted = json.loads(self.tool("--cache-dir", other, "prewarm", "--dry-run", "--json", "--manifest",
                                          manifest, "--target", "sm_80").stdout)
        self.assertEqual({kernel["target"] for kernel in retargeted["kernels"]}, {"sm_80"})
        self.assertEqual(len(retargeted["kernels"]), len(json.loads(listed)["items"]))
        self.tool("--cache-dir", other, "prewarm", "--dry-run", "--manifest", manifest, "--target",
                  "not_an_arch", expect=2)
        plain = [item["spec_json"] for item in json.loads(listed)["items"] if item["state"] == "ok"]
        write_bytes(manifest, json.dumps(plain).encode())
        third = json.loads(self.tool("--cache-dir", other, "prewarm", "--json", "--manifest", manifest,
                                     "--target", "sm_90").stdout)
        self.assertEqual((third["compiled"], third["cached"]), (0, len(plain)))

    @needs_nvrtc
    def test_prewarm_says_what_it_compiled_or_found_cached_and_how_long_it_took(self):
        first = self.tool("--cache-dir", self.root, "prewarm", "--preset", "llama3-8b", "--ops", "rope",
                          "--target", "sm_90")
        lines = first.stdout.splitlines()
        self.assertEqual(sum(line.startswith("compiled ") and (line.endswith(" ms") or line.endswith(" s"))
                             for line in lines[:-1]), 24, first.stdout)
        self.assertIn("24 compiled", lines[-1])
        self.assertIn("sm_90", lines[-1])
        second = self.tool("--cache-dir", self.root, "prewarm", "--preset", "llama3-8b", "--ops", "rope",
                           "--target", "sm_90")
        self.assertEqual(sum(line.startswith("cached ") for line in second.stdout.splitlines()), 24, second.stdout)
        self.assertIn("24 already cached", second.stdout)

    @needs_nvrtc
    def test_prewarm_in_worker_processes_compiles_each_kernel_once_and_reports_it_as_one_process_would(self):
        # Two worker processes of one thread each (prewarm_processes.h): every planned kernel
        # compiled once, written and reported with its own spec; the next run finds them all.
        plan = json.loads(self.tool("--cache-dir", self.root, "prewarm", "--dry-run", "--json", "--target",
                                    "sm_90", *FIVE_SPECS).stdout)
        report, _ = self.prewarm(*FIVE_SPECS, "--processes", "2", "--jobs", "2")
        self.assertEqual((report["processes"], report["jobs"]), (2, 2))
        self.assertEqual((report["compiled"], report["cached"], report["failed"], report["written"]), (5, 0, 0, 5))
        self.assertEqual([k["spec"] for k in report["kernels"]], [k["spec"] for k in plan["kernels"]])
        self.assertTrue(all(k["result"] == "compiled" and k["written"] and k["compile_ms"] > 0
                            for k in report["kernels"]), report)
        self.assertEqual(len(self.items("ok")), 5)
        again, _ = self.prewarm(*FIVE_SPECS, "--processes", "2", "--jobs", "2")
        self.assertEqual((again["compiled"], again["cached"]), (0, 5))
        text = self.tool("--cache-dir", self.root, "prewarm", "--target", "sm_90", "--processes", "2", "--jobs",
                         "2", *FIVE_SPECS).stdout
        self.assertIn("with 2 jobs in 2 processes: 0 compiled", text)

    @needs_nvrtc
    def test_a_worker_process_killed_mid_run_leaves_its_unreported_kernels_failed_and_the_rest_compiled(self):
        process = start_tool("--cache-dir", self.root, "prewarm", "--target", "sm_90", "--json", "--processes", "2",
                             "--jobs", "2", *TWENTY_SPECS)
        victim = None
        deadline = time.time() + 60
        while victim is None and time.time() < deadline:  # the parent's first worker, once started
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    status = read_bytes(f"/proc/{pid}/status").decode()
                    cmdline = read_bytes(f"/proc/{pid}/cmdline")
                except OSError:
                    continue
                if f"PPid:\t{process.pid}\n" in status and b"prewarm-worker" in cmdline:
                    victim = int(pid)
                    break
        self.assertIsNotNone(victim)
        os.kill(victim, signal.SIGKILL)
        out, err = process.communicate(timeout=600)
        self.assertEqual(process.returncode, 1, err)
        report = json.loads(out)
        self.assertEqual(len(report["kernels"]), 20)
        lost = [k for k in report["kernels"] if k["result"] == "failed"]
        self.assertTrue(lost, report)
        self.assertTrue(all("worker process ended (signal 9)" in k["error"] for k in lost), lost)
        self.assertEqual(report["compiled"] + len(lost), 20)
        self.assertEqual(len(self.items("ok")), report["compiled"])

    @unittest.skipUnless(nvml_gpus(), "no GPU that NVML lists")
    def test_prewarm_without_a_target_compiles_for_the_gpus_nvml_lists_and_heeds_cuda_visible_devices(self):
        # NVML first (tools/local_gpus.h: it spares cuInit's 180-230 ms); the expected targets
        # come from NVML through ctypes here.
        expected = sorted({f"sm_{major}{minor}" for _, major, minor in nvml_gpus()})
        def dry_run(visible_devices):
            env = tool_env()
            env.pop("CUDA_VISIBLE_DEVICES", None)
            if visible_devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = visible_devices
            result = subprocess.run([TOOL, "--cache-dir", self.root, "prewarm", "--dry-run", "--json",
                                     "--head-dim", "64"], capture_output=True, text=True, env=env, timeout=120)
            self.assertEqual(result.returncode, 0, result.stderr)
            return json.loads(result.stdout)

        plan = dry_run(None)
        self.assertEqual(sorted(plan["targets"]), expected, plan["note"])
        self.assertTrue(plan["note"].startswith("compiling for the local GPUs: "), plan["note"])
        for name, _, _ in nvml_gpus():
            self.assertIn(name, plan["note"])
        self.assertEqual({k["target"] for k in plan["kernels"]}, set(expected))
        # NVML lists every GPU, CUDA only the visible ones: with CUDA_VISIBLE_DEVICES the
        # runtime names them (its notes number the devices). Every GPU visible: the runtime's
        # targets are NVML's; one: its own.
        if not driver_present():
            self.skipTest("NVML without a CUDA driver: the runtime cannot be asked")
        every = dry_run(",".join(str(i) for i in range(len(nvml_gpus()))))
        self.assertTrue(every["note"].startswith("compiling for the local GPUs: device 0: "), every["note"])
        self.assertEqual(sorted(every["targets"]), expected, every["note"])
        visible = dry_run("0")
        self.assertTrue(visible["note"].startswith("compiling for the local GPUs: device 0: "), visible["note"])
        self.assertEqual(len(visible["targets"]), 1)
        self.assertIn(visible["targets"][0], expected)

    @needs_nvrtc
    @unittest.skipUnless(driver_present(), "no CUDA driver: NVRTC keeps no compute cache here")
    def test_prewarm_writes_nothing_into_the_drivers_compute_cache(self):
        # NVRTC 12.9+ would also cache its optimizer and SASS results in CUDA_CACHE_PATH; the
        # library compiles with --no-cache (nvrtc_compiler.cpp).
        env = tool_env()
        env["CUDA_CACHE_PATH"] = os.path.join(self.scratch, "compute_cache")
        os.makedirs(env["CUDA_CACHE_PATH"])
        subprocess.run([TOOL, "--cache-dir", self.root, "prewarm", "--target", "sm_90", *FIVE_SPECS],
                       check=True, capture_output=True, env=env, timeout=600)
        self.assertEqual([files for _, _, files in os.walk(env["CUDA_CACHE_PATH"]) if files], [])

    @needs_nvrtc
    def test_a_prewarm_killed_with_sigterm_leaves_no_worker_process_compiling(self):
        process = start_tool("--cache-dir", self.root, "prewarm", "--target", "sm_90", "--processes", "2",
                             "--jobs", "2", *TWENTY_SPECS)
        marker = f"\0--parent\0{process.pid}\0".encode()

        def workers():
            found = []
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    if marker in read_bytes(f"/proc/{pid}/cmdline"):
                        found.append(pid)
                except OSError:
                    pass
            return found
        deadline = time.time() + 60
        while not workers() and time.time() < deadline:
            time.sleep(0.01)
        self.assertTrue(workers())
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)
        deadline = time.time() + 10
        while workers() and time.time() < deadline:
            time.sleep(0.05)
        self.assertEqual(workers(), [])

    def test_processes_below_zero_are_a_usage_error(self):
        result = run_tool("--cache-dir", self.root, "prewarm", "--target", "sm_90", "--processes", "-1",
                          "--head-dim", "64")
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertIn("--processes", result.stderr)

    @needs_nvrtc
    def test_a_kernel_that_fails_in_a_worker_process_is_reported_failed_with_its_error(self):
        env = tool_env()
        env["ROPE_JIT_NVRTC_EXTRA_OPTIONS"] = "--no-such-nvrtc-option"
        result = subprocess.run([TOOL, "--cache-dir", self.root, "prewarm", "--target", "sm_90", "--json",
                                 "--processes", "2", "--jobs", "2", *FIVE_SPECS],
                                capture_output=True, text=True, env=env, timeout=600)
        self.assertEqual(result.returncode, 1, result.stderr)
        report = json.loads(result.stdout)
        self.assertEqual((report["processes"], report["failed"], report["compiled"]), (2, 5, 0))
        self.assertTrue(all(k["result"] == "failed" and k["error"] for k in report["kernels"]), report)

    @needs_nvrtc
    def test_prewarm_starts_the_slowest_kernels_first(self):
        # Planned RoPE first, then the attention forward and backward kernels; with one job the
        # output's order is the start order: the attention backward's main kernels (dq and
        # dk/dv at this head_dim), then the forward, then the rest as planned.
        manifest = os.path.join(self.scratch, "manifest.json")
        write_bytes(manifest, json.dumps({"specs": [
            {"head_dim": 64, "dtype": "bfloat16"},
            {"op": "attention", "head_dim": 32, "rotary_dim": 16, "dtype": "bfloat16", "causal": True,
             "write_lse": True, "direction": ["forward", "backward"]},
        ]}).encode())
        plan = json.loads(self.tool("--cache-dir", self.root, "prewarm", "--dry-run", "--json", "--manifest",
                                    manifest, "--target", "sm_90").stdout)
        kinds = [k["spec"]["kind"] if k["spec"]["op"] == "attention" else "rope" for k in plan["kernels"]]
        self.assertEqual(kinds, ["rope", "forward", "backward-dq", "backward-dkdv"])
        planned = [k["description"] for k in plan["kernels"]]
        result = self.tool("--cache-dir", self.root, "prewarm", "-j", "1", "--manifest", manifest,
                           "--target", "sm_90")
        done = [line.split("sm_90", 1)[1].strip().rsplit("  ", 2)[0] for line in result.stdout.splitlines()
                if line.startswith("compiled ")]
        self.assertEqual(done, [planned[2], planned[3], planned[1], planned[0]], result.stdout)

    def test_without_a_gpu_or_target_prewarm_compiles_for_sm_90_and_says_so(self):
        plan = self.tool("--cache-dir", self.root, "prewarm", "--dry-run", "--head-dim", "64")
        info = json.loads(self.tool("--cache-dir", self.root, "info", "--json").stdout)
        if info["devices"]:
            self.skipTest("this machine has a GPU: the default target is the GPU's")
        self.assertIn("no GPU found: compiling for sm_90", plan.stdout)
        self.assertIn("would prewarm  sm_90", plan.stdout)


# ---- issue 20: reliability and security of the cache (helper cache-safety) ------------------

OTHER_UID = 12345


def tree_files(top):
    return sorted(os.path.relpath(os.path.join(path, name), top)
                  for path, _, files in os.walk(top) for name in files)


class ForeignFilesTest(CacheTestCase):
    def test_prune_and_clear_keep_files_in_v1_that_are_not_the_caches(self):
        # S1: a project given as the cache root by mistake loses nothing.
        root = self.root
        os.makedirs(os.path.join(root, "v1", "src"))
        os.makedirs(os.path.join(root, "v1", "x", "y", "z", "dir"))
        os.makedirs(os.path.join(root, "v1", "nvrtc13.0", "notes"))
        os.makedirs(os.path.join(root, "v2", "src"))
        for relative, text in (("v1/src/main.py", b"code"), ("v1/README.md", b"doc"),
                               ("v1/x/y/z/dir/f", b"deep"), ("v2/src/x.py", b"code"),
                               ("v1/nvrtc13.0/notes/todo.txt", b"todo"), ("v1/nvrtc13.0/sm_90.txt", b"n")):
            write_bytes(os.path.join(root, relative), text)
        before = tree_files(root)
        for command in (["prune"], ["clear"]):
            self.tool("--cache-dir", root, *command, "--json")
            self.assertEqual(tree_files(root), before, command)
        self.assertEqual(read_bytes(os.path.join(root, "v1", "x", "y", "z", "dir", "f")), b"deep")


@needs_nvrtc
@unittest.skipUnless(os.geteuid() == 0, "giving files to another user needs root")
class UntrustedEntryTest(CacheTestCase):
    def test_entries_of_another_user_or_under_directories_others_can_write_are_refused(self):
        # S2: verify reports them untrusted (exit 1); a load ignores them with a warning.
        self.prewarm("--head-dim", "64")
        (entry,) = self.items("ok")
        path = entry["path"]
        os.chown(path, OTHER_UID, OTHER_UID)
        report = self.verify(expect=1)
        self.assertEqual([item["state"] for item in report["items"]], ["untrusted"], report)
        self.assertIn(f"uid {OTHER_UID}", report["items"][0]["problem"])
        result, stderr = self.prewarm("--head-dim", "64")
        self.assertEqual((result["compiled"], result["cached"]), (1, 0))
        self.assertTrue(any("not trusted" in line for line in warnings_in(stderr)), stderr)
        os.chown(path, 0, 0)  # (the store above replaced it by now anyway)

        for mode in (0o770, 0o777, 0o1777, 0o1770):
            directory = os.path.dirname(os.path.dirname(path))  # .../sm_90
            os.chmod(directory, mode)
            try:
                report = self.verify(expect=1)
                self.assertEqual([item["state"] for item in report["items"]], ["untrusted"], (oct(mode), report))
                result, stderr = self.prewarm("--head-dim", "64", expect=1)  # nothing can be written
                self.assertEqual((result["compiled"], result["cached"], result["written"]), (1, 0, 0), oct(mode))
            finally:
                os.chmod(directory, 0o700)

    def test_a_root_owned_read_only_bundle_is_used_by_other_users_and_another_users_bundle_is_not(self):
        bundle = os.path.join(self.scratch, "bundle")
        self.prewarm("--head-dim", "64", root=bundle)
        for path, dirs, files in os.walk(bundle):
            os.chmod(path, 0o755)
            for name in files:
                os.chmod(os.path.join(path, name), 0o644)
        os.chmod(self.scratch, 0o755)
        own_root = os.path.join(self.scratch, "user_cache")
        os.mkdir(own_root, 0o700)
        os.chown(own_root, OTHER_UID, OTHER_UID)
        env = tool_env()
        env["ROPE_JIT_CACHE_RO_DIRS"] = bundle

        def as_other_user():
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)

        args = [TOOL, "--cache-dir", own_root, "prewarm", "--target", "sm_90", "--json", "--head-dim", "64"]
        result = subprocess.run(args, capture_output=True, text=True, env=env, preexec_fn=as_other_user)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        report = json.loads(result.stdout)
        self.assertEqual((report["compiled"], report["cached"]), (0, 1), result.stderr)
        self.assertEqual(warnings_in(result.stderr), [])

        # The same bundle owned by another user is not trusted by root.
        for path, dirs, files in os.walk(bundle):
            os.chown(path, OTHER_UID, OTHER_UID)
        env["ROPE_JIT_CACHE_RO_DIRS"] = bundle
        result = subprocess.run(args[:2] + [os.path.join(self.scratch, "root_cache")] + args[3:],
                                capture_output=True, text=True, env=env)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        report = json.loads(result.stdout)
        self.assertEqual((report["compiled"], report["cached"]), (1, 0), result.stderr)
        self.assertTrue(any(f"uid {OTHER_UID}" in line for line in warnings_in(result.stderr)), result.stderr)


@needs_nvrtc
class WrongKernelTest(CacheTestCase):
    def test_an_entry_holding_another_kernels_spec_is_not_loaded_and_fails_verify(self):
        # S3: a valid entry (right key echo and checksum) whose stored spec is another kernel.
        self.prewarm("--head-dim", "64,128")
        entries = {item["spec_json"]["head_dim"]: item for item in self.items("ok")}
        _, key64, _, _ = cache_entry_format.parse(read_bytes(entries[64]["path"]))
        _, _, spec128, payload128 = cache_entry_format.parse(read_bytes(entries[128]["path"]))
        write_bytes(entries[64]["path"], cache_entry_format.serialize(key64, spec128, payload128))
        report = self.verify(expect=1)
        self.assertFalse(report["healthy"])
        result, stderr = self.prewarm("--head-dim", "64")
        self.assertEqual((result["compiled"], result["cached"]), (1, 0), stderr)
        self.assertTrue(any("spec" in line for line in warnings_in(stderr)), stderr)
        self.verify(expect=0)


    def test_an_entry_whose_stored_spec_nests_deeply_is_damaged_and_every_command_still_runs(self):
        # A valid checksum around a spec of 300000 nested lists: reading it quoted the value in
        # an error, whose printing recursed and overflowed the stack of verify, list, prune and
        # clear --dry-run (adversarial test, session 32).
        self.prewarm("--head-dim", "64")
        entry = self.items("ok")[0]
        key = os.path.basename(entry["path"]).split(".")[0]
        deep = '{"head_dim": ' + "[" * 300000 + "]" * 300000 + "}"
        path = os.path.join(os.path.dirname(os.path.dirname(entry["path"])), "ab", "ab" + key[2:] + ".cubin")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_bytes(path, cache_entry_format.serialize("ab" + key[2:], deep, b"payload"))
        report = self.verify(expect=1)
        damaged = [item for item in report["items"] if item["path"] == path]
        self.assertEqual(len(damaged), 1, report)
        self.assertNotEqual(damaged[0]["state"], "ok")
        self.tool("--cache-dir", self.root, "list")
        self.tool("--cache-dir", self.root, "clear", "--dry-run")
        self.tool("--cache-dir", self.root, "prune")
        self.assertFalse(os.path.exists(path))
        self.verify(expect=0)


@needs_nvrtc
@unittest.skipUnless(os.geteuid() == 0, "changing a directory's owner needs root")
class UnwrittenPrewarmTest(CacheTestCase):
    def test_prewarm_exits_1_when_an_entry_could_not_be_written(self):
        # S4: the root belongs to another user: every kernel compiles, none is written.
        os.mkdir(self.root, 0o700)
        os.chown(self.root, OTHER_UID, OTHER_UID)
        result, stderr = self.prewarm("--head-dim", "64,128", expect=1)
        self.assertEqual((result["compiled"], result["failed"], result["written"]), (2, 0, 0))
        text = self.tool("--cache-dir", self.root, "prewarm", "--target", "sm_90", "--head-dim", "64", expect=1)
        self.assertIn("not written", text.stdout + text.stderr)


class HugeFileTest(CacheTestCase):
    def test_a_huge_file_named_like_an_entry_is_rejected_from_its_header_quickly(self):
        # S5: a sparse 1 GB file is judged by its first bytes, not read whole.
        directory = os.path.join(self.root, "v1", "nvrtc13.0", "sm_90", "ab")
        os.makedirs(directory, mode=0o700)
        os.chmod(self.root, 0o700)
        huge = os.path.join(directory, "ab" + "0" * 62 + ".cubin")
        with open(huge, "wb") as file:
            file.truncate(1 << 30)
        # Under the 64 MiB payload limit: judged by its magic, not read whole.
        large = os.path.join(directory, "ab" + "1" * 62 + ".cubin")
        with open(large, "wb") as file:
            file.truncate(40 << 20)

        def small_memory():
            # Reading the 1 GB file whole would fail under this (ASan reserves terabytes of
            # shadow memory, so a sanitized build runs without it: the time limit still holds).
            if b"__asan_init" not in read_bytes(TOOL):
                resource.setrlimit(resource.RLIMIT_DATA, (512 << 20, 512 << 20))

        start = time.monotonic()
        result = run_tool("--cache-dir", self.root, "verify", "--json", preexec_fn=small_memory)
        elapsed = time.monotonic() - start
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        items = {item["path"]: item for item in json.loads(result.stdout)["items"]}
        self.assertEqual([item["state"] for item in items.values()], ["damaged", "damaged"])
        self.assertIn("larger than any valid entry", items[huge]["problem"])
        self.assertIn("bad magic", items[large]["problem"])
        self.assertLess(elapsed, 2.0)


class CommandLineSafetyTest(CacheTestCase):
    def test_an_unknown_subcommand_is_named(self):
        result = self.tool("bogus", expect=2)
        self.assertIn("bogus", result.stderr)
        self.assertNotIn("A subcommand is required", result.stderr)

    def test_text_output_escapes_control_characters_in_file_names(self):
        root = os.path.join(self.scratch, "cache\x1b[31m\rred")
        directory = os.path.join(root, "v1", "nvrtc13.0", "sm_90", "ab")
        os.makedirs(directory, mode=0o700)
        for path in (root, os.path.join(root, "v1")):
            os.chmod(path, 0o700)
        write_bytes(os.path.join(directory, "ab" + "0" * 62 + ".cubin"), b"damaged")
        for command in ("list", "verify", "prune", "info"):
            result = run_tool("--cache-dir", root, command)
            self.assertNotIn("\x1b", result.stdout + result.stderr, command)
            self.assertNotIn("\r", result.stdout + result.stderr, command)
            self.assertIn("\\x1b[31m\\rred", result.stdout + result.stderr, command)

    def test_rope_jit_bench_help_prints_usage_and_exits_0(self):
        bench = os.path.join(os.path.dirname(TOOL), "rope-jit-bench")
        if not os.access(bench, os.X_OK):
            self.skipTest("rope-jit-bench is not built next to rope-jit-cache")
        result = subprocess.run([bench, "--help"], capture_output=True, text=True, timeout=60)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("usage: rope-jit-bench", result.stdout)


@needs_nvrtc
class BoundedCacheTest(CacheTestCase):
    def test_writes_past_rope_jit_cache_max_bytes_evict_the_least_recently_used_entries(self):
        self.prewarm("--head-dim", "64")
        (first,) = self.items("ok")
        budget = 3 * first["bytes"] + first["bytes"] // 2  # room for three entries of this size
        env = tool_env()
        env["ROPE_JIT_CACHE_MAX_BYTES"] = str(budget)
        for head_dim in (32, 96, 128, 160, 192):
            result = subprocess.run([TOOL, "--cache-dir", self.root, "prewarm", "--target", "sm_90", "--json",
                                     "--head-dim", str(head_dim), "--jobs", "1"],
                                    capture_output=True, text=True, env=env)
            self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
            self.assertEqual(warnings_in(result.stderr), [])
            ok = self.items("ok")
            self.assertLessEqual(sum(item["bytes"] for item in ok), budget)
            self.assertIn(head_dim, [item["spec_json"]["head_dim"] for item in ok])
        kept = sorted(item["spec_json"]["head_dim"] for item in self.items("ok"))
        self.assertEqual(kept[-1], 192)
        self.assertNotIn(64, kept)  # the oldest went first
        # Unbounded with 0; a bad value names the variable (in prewarm, which writes: list,
        # verify, prune and clear do not read it, MaxBytesEnvironmentTest below).
        env["ROPE_JIT_CACHE_MAX_BYTES"] = "lots"
        result = subprocess.run([TOOL, "--cache-dir", self.root, "prewarm", "--target", "sm_90", "--head-dim", "64"],
                                capture_output=True, text=True, env=env)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("ROPE_JIT_CACHE_MAX_BYTES", result.stderr)


# ---- the tool's fixes after the adversarial test of session 35 --------------------------------

LIST_ITEM_SPEC = {"op": "rope", "head_dim": 64}


def make_layout_dirs(root, *parts):
    """root/parts..., every directory private (as the cache makes them); the last one's path."""
    path = root
    os.makedirs(path, mode=0o700, exist_ok=True)
    for part in parts:
        path = os.path.join(path, part)
        os.mkdir(path, 0o700)
    return path


class ManifestFieldTypeTest(CacheTestCase):
    def test_a_list_manifest_whose_state_or_command_is_not_a_string_is_a_usage_error_naming_the_field(self):
        # These exited 1 with nlohmann's "[json.exception.type_error.302] type must be string".
        manifest = os.path.join(self.scratch, "m1.json")
        for state in (1, None, ["ok"], {"ok": True}, True):
            write_bytes(manifest, json.dumps({"command": "list", "items": [
                {"state": state, "target": "sm_90", "spec_json": LIST_ITEM_SPEC}]}).encode())
            result = self.tool("--cache-dir", self.root, "prewarm", "--manifest", manifest, expect=2)
            self.assertIn(f"{manifest}: items[0].state: expected a string", result.stderr, state)
            self.assertNotIn("json.exception", result.stderr, state)
        # The second item's, after a good first one.
        write_bytes(manifest, json.dumps({"command": "list", "items": [
            {"state": "ok", "target": "sm_90", "spec_json": LIST_ITEM_SPEC},
            {"state": 7, "target": "sm_90", "spec_json": LIST_ITEM_SPEC}]}).encode())
        result = self.tool("--cache-dir", self.root, "prewarm", "--dry-run", "--manifest", manifest, expect=2)
        self.assertIn(f"{manifest}: items[1].state: expected a string, got 7", result.stderr)
        for command in (5, None, ["list"], {"name": "list"}):
            write_bytes(manifest, json.dumps({"command": command, "items": []}).encode())
            result = self.tool("--cache-dir", self.root, "prewarm", "--manifest", manifest, expect=2)
            self.assertIn(manifest, result.stderr, command)
            self.assertIn("command: expected a string", result.stderr, command)
            self.assertNotIn("json.exception", result.stderr, command)
        self.assertFalse(os.path.exists(self.root))

    def test_list_manifest_items_list_never_writes_are_usage_errors_naming_the_item(self):
        # Skipped without a word, exit 0 (an empty target took the default one); items of
        # another state list writes are still skipped (adversarial pass, session 49).
        manifest = os.path.join(self.scratch, "m2.json")
        good = {"state": "ok", "target": "sm_90", "spec_json": LIST_ITEM_SPEC}
        for item, message in [
            (5, "items[1]: expected an object, got a number"),
            ("x", "items[1]: expected an object, got a string"),
            (None, "items[1]: expected an object, got a null"),
            ([good], "items[1]: expected an object, got an array"),
            (dict(good, state="okay"), 'items[1].state: expected one of ok, stale, damaged, temp, '
                                       'set-aside, stray, untrusted, unknown, got "okay"'),
            ({"target": "sm_90", "spec_json": LIST_ITEM_SPEC}, "items[1] has no state"),
            (dict(good, target=""), "items[1].target: empty"),
        ]:
            write_bytes(manifest, json.dumps({"command": "list", "items": [good, item]}).encode())
            result = self.tool("--cache-dir", self.root, "prewarm", "--dry-run", "--manifest", manifest, expect=2)
            self.assertIn(f"{manifest}: {message}", result.stderr, item)
        # ("unknown": what list writes for a state of a newer library than it knows.)
        write_bytes(manifest, json.dumps({"command": "list", "items": [
            good, dict(good, state="stale", target=""), dict(good, state="damaged"),
            dict(good, state="unknown")]}).encode())
        planned = json.loads(self.tool("--cache-dir", self.root, "prewarm", "--dry-run", "--json", "--manifest",
                                       manifest).stdout)
        self.assertEqual([kernel["sources"] for kernel in planned["kernels"]], [[f"{manifest}#items[0]"]])
        self.assertFalse(os.path.exists(self.root))


class MaxBytesEnvironmentTest(CacheTestCase):
    def test_list_verify_prune_and_clear_ignore_a_malformed_size_limit_and_prewarm_refuses_it(self):
        # A value like "2g" made every command fail creating its runtime, so the cache could
        # not even be cleaned up; only prewarm, which writes entries, applies the limit.
        directory = make_layout_dirs(self.root, "v1", "nvrtc13.0", "sm_90", "ab")
        damaged = os.path.join(directory, "ab" + "0" * 62 + ".cubin")
        write_bytes(damaged, b"damaged")
        temp = os.path.join(directory, ".tmp-1-2-3")
        write_bytes(temp, b"half")
        old = time.time() - 3600
        os.utime(temp, (old, old))
        env = dict(tool_env(), ROPE_JIT_CACHE_MAX_BYTES="2g")

        def run(*args):
            return subprocess.run([TOOL, "--cache-dir", self.root, *args], capture_output=True, text=True,
                                  env=env, timeout=120)

        listed = run("list", "--json")
        self.assertEqual(listed.returncode, 0, listed.stderr)
        self.assertEqual(sorted(item["state"] for item in json.loads(listed.stdout)["items"]), ["damaged", "temp"])
        verified = run("verify", "--json")
        self.assertEqual(verified.returncode, 1, verified.stderr)  # damage found, not a failure to start
        self.assertEqual(len(json.loads(verified.stdout)["items"]), 2)
        for result in (listed, verified):
            self.assertNotIn("ROPE_JIT_CACHE_MAX_BYTES", result.stderr)
        pruned = run("prune", "--json")
        self.assertEqual(pruned.returncode, 0, pruned.stderr)
        self.assertEqual(sorted(item["path"] for item in json.loads(pruned.stdout)["removed"]), sorted([damaged, temp]))
        self.assertFalse(os.path.exists(damaged) or os.path.exists(temp))
        write_bytes(damaged, b"damaged again")
        cleared = run("clear")
        self.assertEqual(cleared.returncode, 0, cleared.stderr)
        self.assertFalse(os.path.exists(damaged))

        prewarm = run("prewarm", "--target", "sm_90", "--head-dim", "64")
        self.assertNotEqual(prewarm.returncode, 0)
        self.assertIn("ROPE_JIT_CACHE_MAX_BYTES: '2g' is not a size in bytes", prewarm.stderr)
        self.assertEqual(os.listdir(directory), [])


class FutureTimeStampTest(CacheTestCase):
    def test_prune_removes_temp_files_stamped_more_than_a_day_ahead_and_keeps_fresh_ones(self):
        # A time stamp in the future (a bundle from a machine whose clock was wrong) made a
        # temp file look just written, forever: prune never removed it.
        directory = make_layout_dirs(self.root, "v1", "nvrtc13.0", "sm_90", "ab")
        now = time.time()
        stamps = {"far": (1, now + 3 * 86400), "ahead": (2, now + 3600), "now": (3, now)}
        paths = {}
        for name, (pid, stamp) in stamps.items():
            paths[name] = os.path.join(directory, f".tmp-{pid}-1-2")
            write_bytes(paths[name], b"half")
            os.utime(paths[name], (stamp, stamp))
        pruned = json.loads(self.tool("--cache-dir", self.root, "prune", "--json").stdout)
        self.assertEqual([(item["path"], item["reason"]) for item in pruned["removed"]],
                         [(paths["far"], "leftover temp file")])
        self.assertFalse(os.path.exists(paths["far"]))
        # Less than a day ahead is within the clock skew allowed: still a write in progress.
        self.assertTrue(os.path.exists(paths["ahead"]) and os.path.exists(paths["now"]))

    @needs_nvrtc
    def test_prune_counts_an_entry_used_more_than_a_day_ahead_as_unused_for_an_unknown_time(self):
        # Such an entry looked used just now, forever: --older-than never removed it, and
        # --max-bytes removed every other entry first.
        self.prewarm("--head-dim", "64,128")
        entries = {item["spec_json"]["head_dim"]: item for item in self.items("ok")}
        future, past = entries[64]["path"], entries[128]["path"]
        now = time.time()

        def stamp():
            os.utime(future, (now + 3 * 86400, now + 3 * 86400))
            os.utime(past, (now - 3600, now - 3600))

        stamp()
        pruned = json.loads(self.tool("--cache-dir", self.root, "prune", "--older-than", "1d", "--json").stdout)
        self.assertEqual([item["path"] for item in pruned["removed"]], [future])
        self.assertIn("unused for an unknown time", pruned["removed"][0]["reason"])
        self.assertEqual([item["path"] for item in self.items("ok")], [past])

        # Over a size limit, an unknown age goes before any known one.
        self.prewarm("--head-dim", "64")
        stamp()
        budget = max(entries[64]["bytes"], entries[128]["bytes"])
        pruned = json.loads(self.tool("--cache-dir", self.root, "prune", "--max-bytes", str(budget), "--json").stdout)
        self.assertEqual([item["path"] for item in pruned["removed"]], [future])
        self.assertIn("least recently used", pruned["removed"][0]["reason"])
        self.assertEqual([item["path"] for item in self.items("ok")], [past])


class ListedTargetsTest(CacheTestCase):
    def listing(self, *targets):
        manifest = os.path.join(self.scratch, "listed.json")
        write_bytes(manifest, json.dumps({"command": "list", "items": [
            {"state": "ok", "target": target, "spec_json": LIST_ITEM_SPEC} for target in targets]}).encode())
        return manifest

    def test_prewarm_of_a_list_manifest_plans_its_items_targets_and_chooses_no_other(self):
        # It chose targets anyway: "no GPU found: compiling for sm_90" (or the local GPUs),
        # and reported those instead of the items' own.
        manifest = self.listing("compute_90a", "sm_80")
        plan = json.loads(self.tool("--cache-dir", self.root, "prewarm", "--dry-run", "--json", "--manifest",
                                    manifest).stdout)
        self.assertEqual(plan["targets"], ["compute_90a", "sm_80"])
        self.assertEqual(plan["note"], "")
        self.assertEqual([kernel["target"] for kernel in plan["kernels"]], ["compute_90a", "sm_80"])
        text = self.tool("--cache-dir", self.root, "prewarm", "--dry-run", "--manifest", manifest).stdout
        self.assertNotIn("no GPU found", text)
        self.assertNotIn("local GPUs", text)

    @needs_nvrtc
    def test_prewarm_of_a_list_manifest_reports_the_targets_it_compiled_for(self):
        result = self.tool("--cache-dir", self.root, "prewarm", "--manifest", self.listing("compute_90a"))
        self.assertNotIn("no GPU found", result.stdout + result.stderr)
        self.assertIn("prewarm: 1 kernels for compute_90a in ", result.stdout.splitlines()[-1])
        self.assertEqual([item["target"] for item in self.items("ok")], ["compute_90a"])


if __name__ == "__main__":
    unittest.main(verbosity=2)
