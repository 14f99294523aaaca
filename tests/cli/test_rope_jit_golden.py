"""rope-jit-golden on malformed case directories: a case that cannot be checked never counts as
passed, a manifest it cannot read is a usage error (exit 2), and nothing crashes or hangs
(adversarial pass, session 35: a negative tolerance passed anything, an infinite expected
value passed by position, a selection of no case exited 0, a huge head_dim crashed the runner,
a deeply nested tolerance overflowed the stack, a FIFO manifest blocked; session 47: a case
whose outputs the runner rejects read its files whole first, 4 GB for a sparse 4 GiB file).

Run by ctest as `python3 test_rope_jit_golden.py` with ROPE_JIT_GOLDEN_TOOL naming the binary.
The cases are inv_freq ones (rope_jit_inv_freq runs on the host: no backend, no NVRTC).
"""
import json
import os
import struct
import subprocess
import shutil
import tempfile
import threading
import unittest

TOOL = os.environ.get("ROPE_JIT_GOLDEN_TOOL", "")
SHARED_CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "golden")
HEAD_DIM = 8


def default_inv_freq(head_dim=HEAD_DIM, theta=10000.0):
    """HF's default rope type, as float32 values: theta^(-2i/head_dim)."""
    return [theta ** (-2.0 * i / head_dim) for i in range(head_dim // 2)]


def write_case_dir(root, params=None, tolerance=None, inv_freq=None, extra_cases=()):
    """A case directory with one inv_freq case (HF default, head_dim 8) whose parts the caller
    may replace; returns its path."""
    os.makedirs(root, exist_ok=True)
    values = default_inv_freq() if inv_freq is None else inv_freq
    with open(os.path.join(root, "inv_freq.bin"), "wb") as file:
        file.write(struct.pack(f"<{len(values)}f", *values))
    case = {
        "name": "hf_default",
        "op": "inv_freq",
        "params": params if params is not None else {"rope_type": "default", "head_dim": HEAD_DIM},
        "inputs": {},
        "outputs": {"inv_freq": {"file": "inv_freq.bin", "dtype": "float32",
                                 "shape": [len(values)]}},
        "tolerance": tolerance if tolerance is not None else {"atol": 1e-6, "rtol": 1e-5},
    }
    manifest = {"format": "rope-jit-golden/1", "cases": [case, *extra_cases]}
    with open(os.path.join(root, "manifest.json"), "w") as file:
        json.dump(manifest, file)
    return root


def run_tool(directory, *args, timeout=60):
    return subprocess.run([TOOL, directory, "--backend", "cpu", *args], capture_output=True,
                          text=True, timeout=timeout)


def run_tool_measuring_memory(directory, timeout=60):
    """run_tool's result and the tool's peak resident memory in bytes (wait4's rusage); a tool
    still running after `timeout` seconds is killed (and its result fails)."""
    with tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen([TOOL, directory, "--backend", "cpu"], stdout=stdout,
                                   stderr=stderr)
        killer = threading.Timer(timeout, process.kill)
        killer.start()
        _, status, usage = os.wait4(process.pid, 0)
        killer.cancel()
        process.returncode = os.waitstatus_to_exitcode(status)
        stdout.seek(0)
        stderr.seek(0)
        result = subprocess.CompletedProcess(process.args, process.returncode,
                                             stdout.read().decode(), stderr.read().decode())
    return result, usage.ru_maxrss * 1024  # (Linux reports kilobytes)


@unittest.skipUnless(TOOL, "ROPE_JIT_GOLDEN_TOOL is not set")
class GoldenRunnerTest(unittest.TestCase):
    def setUp(self):
        self.scratch = tempfile.TemporaryDirectory(prefix="rope_jit_golden_cli_")
        self.root = self.scratch.name

    def tearDown(self):
        self.scratch.cleanup()

    def case_dir(self, name, **parts):
        return write_case_dir(os.path.join(self.root, name), **parts)

    def assert_fails(self, result, needle):
        output = result.stdout + result.stderr
        self.assertEqual(result.returncode, 1, output)
        self.assertIn("0 passed, 1 failed", output)
        self.assertIn(needle, output)

    def test_a_well_formed_case_passes(self):
        result = run_tool(self.case_dir("ok"))
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("1 passed, 0 failed", result.stdout)

    def test_a_negative_tolerance_fails_the_case_even_with_right_values(self):
        for name, tolerance in (("negative_atol", {"atol": -1e-9, "rtol": 0}),
                                ("negative_rtol", {"atol": 1e-6, "rtol": -1e-9})):
            with self.subTest(name):
                result = run_tool(self.case_dir(name, tolerance=tolerance))
                self.assert_fails(result, "atol and rtol must be finite and >= 0")

    def test_a_zero_tolerance_passes_exact_values_negative_zero_included(self):
        for name, tolerance in (("zero", {"atol": 0, "rtol": 0}),
                                ("negative_zero", {"atol": -0.0, "rtol": -0.0})):
            with self.subTest(name):
                # theta 16 at head_dim 8: inverse frequencies 1, 1/2, 1/4, 1/8, exact in float32.
                params = {"rope_type": "default", "head_dim": HEAD_DIM, "rope_theta": 16.0}
                result = run_tool(self.case_dir(name, params=params, tolerance=tolerance,
                                                inv_freq=[1.0, 0.5, 0.25, 0.125]))
                self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
                self.assertIn("1 passed, 0 failed", result.stdout)

    def test_wrong_values_fail_whatever_tolerance_a_case_gives(self):
        shifted = [value + 1.0 for value in default_inv_freq()]
        result = run_tool(self.case_dir("shifted", inv_freq=shifted,
                                        tolerance={"atol": 1e-6, "rtol": 0}))
        self.assert_fails(result, "fail")

    def test_an_infinite_expected_value_fails_wherever_it_stands(self):
        for index in (0, 1, 3):
            with self.subTest(index=index):
                values = default_inv_freq()
                values[index] = float("inf")
                result = run_tool(self.case_dir(f"inf{index}", inv_freq=values))
                self.assert_fails(result, "inf")

    def test_selecting_no_case_exits_1(self):
        typo = run_tool(self.case_dir("ok"), "--case", "no such case")
        self.assertEqual(typo.returncode, 1, typo.stdout + typo.stderr)
        self.assertIn("no case matched the selection", typo.stderr)
        empty = os.path.join(self.root, "empty")
        os.makedirs(empty)
        with open(os.path.join(empty, "manifest.json"), "w") as file:
            json.dump({"format": "rope-jit-golden/1", "cases": []}, file)
        result = run_tool(empty)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)

    def test_sizes_out_of_range_fail_the_case_without_crashing(self):
        for name, params in (
            ("head_dim_1e300", {"rope_type": "default", "head_dim": 1e300}),
            ("dim_1e12", {"rope_type": "default", "head_dim": 8, "dim": 1e12}),
            ("proportional_huge", {"rope_type": "proportional", "head_dim": 1e300,
                                   "partial_rotary_factor": 0.5}),
        ):
            with self.subTest(name):
                result = run_tool(self.case_dir(name, params=params))
                self.assert_fails(result, "params")

    def test_a_case_failing_its_checks_reads_none_of_its_files(self):
        # Each case (an inv_freq one made here, the shared folder's first rope and attention
        # cases) declares a sparse 4 GiB array (no disk, but 4 GB of zeros to read) that the
        # runner rejects by its name or shape, which it knows before reading a byte.
        with open(os.path.join(SHARED_CASES, "manifest.json")) as file:
            shared = json.load(file)["cases"]
        rope = next(case for case in shared if case["op"] == "rope")
        attention = next(case for case in shared if case["op"] == "attention")
        huge = {"file": "huge.bin", "dtype": "float32", "shape": [1 << 30]}
        item_sizes = {"float32": 4, "bfloat16": 2, "float16": 2}
        q_dtype = rope["inputs"]["q"]["dtype"]
        for name, case, section, arrays, needle in (
            ("unknown_output", None, "outputs", {"bogus": huge}, "output 'bogus' is not part of"),
            ("attention_factor_not_scalar", None, "outputs", {"attention_factor": huge},
             "output 'attention_factor': expected [1]"),
            ("inv_freq_of_two_dims", None, "outputs",
             {"inv_freq": dict(huge, shape=[1 << 15, 1 << 15])},
             "output 'inv_freq': expected [n]"),
            ("rope_output_shape", rope, "outputs",
             {"q": dict(huge, dtype=q_dtype, shape=[(4 << 30) // item_sizes[q_dtype]])},
             "output 'q': expected the input's shape"),
            ("rope_q_position_offset", rope, "inputs",
             {"q_position_offset": dict(huge, dtype="int32")},
             "input 'q_position_offset': expected [1]"),
            ("attention_lse_shape", attention, "outputs", {"lse": huge},
             "output 'lse': expected shape"),
        ):
            with self.subTest(name):
                directory = self.case_dir(name)
                if case is not None:
                    case = json.loads(json.dumps(case))
                    for entry in (*case["inputs"].values(), *case["outputs"].values()):
                        copy = os.path.join(directory, entry["file"])
                        os.makedirs(os.path.dirname(copy), exist_ok=True)
                        shutil.copy(os.path.join(SHARED_CASES, entry["file"]), copy)
                with open(os.path.join(directory, "huge.bin"), "wb") as file:
                    file.truncate(4 << 30)
                with open(os.path.join(directory, "manifest.json")) as file:
                    manifest = json.load(file)
                if case is not None:
                    manifest["cases"] = [case]
                manifest["cases"][0][section].update(arrays)
                with open(os.path.join(directory, "manifest.json"), "w") as file:
                    json.dump(manifest, file)
                result, peak_bytes = run_tool_measuring_memory(directory)
                self.assert_fails(result, needle)
                self.assertLess(peak_bytes, 1 << 30)

    def test_unreadable_manifests_are_usage_errors(self):
        deep = os.path.join(self.root, "deep")
        os.makedirs(deep)
        with open(os.path.join(deep, "manifest.json"), "w") as file:
            file.write('{"format": "rope-jit-golden/1", "cases": [{"tolerance": '
                       + "[" * 100000 + "]" * 100000 + "}]}")
        directory = os.path.join(self.root, "directory")
        os.makedirs(os.path.join(directory, "manifest.json"))
        fifo = os.path.join(self.root, "fifo")
        os.makedirs(fifo)
        os.mkfifo(os.path.join(fifo, "manifest.json"))
        for path, needle in ((deep, "nests deeper"), (directory, "not a regular file"),
                             (fifo, "not a regular file")):
            with self.subTest(path):
                result = run_tool(path, timeout=30)  # (the FIFO blocked the read for good)
                self.assertEqual(result.returncode, 2, result.stdout + result.stderr)
                self.assertIn(needle, result.stderr)


if __name__ == "__main__":
    unittest.main()
