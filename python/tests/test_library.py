"""Loading librope_jit, its version, statuses as exceptions, the runtime, and the ctypes
mirrors of the C structs."""

import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import rope_jit
from rope_jit import _structs

np = pytest.importorskip("numpy")


def run_python(code, env, cwd=None):
    # cwd: where `python -c` looks first for packages (it puts "" on sys.path).
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_the_library_loads_and_reports_a_version_that_matches_its_version_number(library):
    version = rope_jit.library_version()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    major, minor, patch = (int(part) for part in version.split("."))
    assert library.rope_jit_version_number() == major * 10000 + minor * 100 + patch


def test_each_ctypes_mirror_has_the_size_its_init_function_writes(library):
    mirrors = [(_structs.Config, "rope_jit_config_init"), (_structs.RopeArgs, "rope_jit_rope_args_init"),
               (_structs.KernelSpec, "rope_jit_kernel_spec_init"), (_structs.Stats, "rope_jit_stats_init"),
               (_structs.AttentionArgs, "rope_jit_attention_args_init"),
               (_structs.FreqConfig, "rope_jit_freq_config_init"),
               (_structs.TableConfig, "rope_jit_table_config_init")]
    checked = 0
    for cls, init_name in mirrors:
        init = library.optional(init_name, None, [ctypes.POINTER(cls)])
        if init is None:
            continue  # an op this build of the library does not have yet
        scratch = (ctypes.c_char * 4096)()
        init(ctypes.cast(scratch, ctypes.POINTER(cls)))
        assert ctypes.c_size_t.from_buffer(scratch).value == ctypes.sizeof(cls), cls.__name__
        checked += 1
    assert checked >= 4


def test_a_bad_argument_raises_invalid_argument_error_with_the_library_message_naming_it(cpu_runtime):
    q = np.zeros((1, 2, 3, 5), np.float32)  # odd head_dim
    with pytest.raises(rope_jit.InvalidArgumentError) as caught:
        rope_jit.rope(q, inv_freq=np.ones(2, np.float32), runtime=cpu_runtime)
    error = caught.value
    assert isinstance(error, ValueError) and isinstance(error, rope_jit.RopeJitError)
    assert error.status == 1 and error.status_name == "ERROR_INVALID_ARGUMENT"
    assert error.function == "rope_jit_rope"
    assert "q" in error.detail and "head_dim" in error.detail
    assert str(error).startswith("rope_jit_rope: ERROR_INVALID_ARGUMENT: ")


def test_every_status_value_maps_to_its_own_exception_class():
    from rope_jit.errors import error_for_status
    expected = {1: rope_jit.InvalidArgumentError, 2: rope_jit.UnsupportedError, 3: rope_jit.BackendUnavailableError,
                4: rope_jit.OutOfMemoryError, 5: rope_jit.CompileError, 6: rope_jit.CudaError,
                7: rope_jit.CacheError, 8: rope_jit.InternalError, 99: rope_jit.RopeJitError}
    for status, cls in expected.items():
        error = error_for_status("f", status, "NAME", "detail")
        assert type(error) is cls and error.status == status and str(error) == "f: NAME: detail"


def test_a_missing_library_path_in_the_environment_is_an_error_that_names_it(tmp_path):
    missing = tmp_path / "nowhere" / "librope_jit.so"
    env = dict(os.environ, ROPE_JIT_LIBRARY=str(missing))
    result = run_python("import rope_jit\ntry:\n    rope_jit.load_library()\nexcept rope_jit.LibraryNotFoundError as e:"
                        "\n    print('ERROR', e)\n", env)
    assert "ERROR" in result.stdout, result.stderr
    assert str(missing) in result.stdout and "ROPE_JIT_LIBRARY" in result.stdout


def test_a_relative_library_path_is_the_file_in_the_current_folder(library, tmp_path):
    # "./librope_jit.so" lost its "./" on the way to dlopen, which then searched its own path
    # (a system copy would have loaded silently; adversarial pass, session 35).
    import shutil

    shutil.copy(library.path, tmp_path / "librope_jit.so")
    code = "import rope_jit; print(rope_jit.default_runtime().library.path)"
    for name in ("./librope_jit.so", "librope_jit.so"):
        env = dict(os.environ, ROPE_JIT_LIBRARY=name)
        result = run_python(code, env, cwd=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.strip() == str(tmp_path / "librope_jit.so")


def test_importing_the_package_needs_neither_the_library_nor_torch(tmp_path):
    env = dict(os.environ, ROPE_JIT_LIBRARY=str(tmp_path / "absent.so"))
    result = run_python("import sys, rope_jit\nprint('torch' in sys.modules, 'numpy' in sys.modules)", env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]
    # The submodules the package docstring lists are its attributes (frequencies was not:
    # review, session 39); torch_ops comes on first use (with torch).
    names = "rope attention frequencies dropin runtime tensors errors".split()
    result = run_python(f"import rope_jit\nfor name in {names}: getattr(rope_jit, name)", env)
    assert result.returncode == 0, result.stderr


def test_the_library_is_found_in_the_package_folder_and_on_the_loader_path(library, tmp_path):
    built = Path(library.path).resolve()
    package = tmp_path / "site" / "rope_jit"
    shutil.copytree(Path(rope_jit.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__", "*.so*"))
    shutil.copy(built, package / "librope_jit.so")
    env = {key: value for key, value in os.environ.items() if key != "ROPE_JIT_LIBRARY"}
    env["PYTHONPATH"] = str(package.parent)
    result = run_python("import rope_jit; print(rope_jit.library_path())", env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(package / "librope_jit.so")

    os.remove(package / "librope_jit.so")
    lib_dir = tmp_path / "lib"
    lib_dir.mkdir()
    shutil.copy(built, lib_dir / "librope_jit.so.0")
    env["LD_LIBRARY_PATH"] = str(lib_dir)
    result = run_python("import rope_jit; print(rope_jit.library_path(), rope_jit.library_version())", env,
                        cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == "librope_jit.so.0"


def test_a_cpu_runtime_says_cpu_counts_nothing_before_work_and_refuses_use_after_close(library):
    runtime = rope_jit.Runtime(backend="cpu", disk_cache=False)
    assert runtime.backend == "cpu"
    stats = runtime.stats()
    assert set(stats) == {"memory_hits", "disk_hits", "compiles", "compile_ms", "disk_writes", "launches",
                          "background_builds", "background_failures", "background_dropped",
                          "attention_workspace_fallbacks", "disk_lookup_ms", "module_load_ms",
                          "disk_evictions"}
    assert stats["compiles"] == 0 and stats["launches"] == 0
    runtime.close()
    runtime.close()  # a second close is a no-op
    with pytest.raises(ValueError, match="closed"):
        runtime.backend


def test_a_bad_backend_name_is_a_value_error_that_lists_the_choices(library):
    with pytest.raises(ValueError, match="backend"):
        rope_jit.Runtime(backend="tpu")


def test_optional_ops_are_reported_and_raise_not_implemented_when_absent(library, cpu_runtime):
    has = library.optional("rope_jit_attention", ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p]) is not None
    assert rope_jit.has_attention(cpu_runtime) == has
    if not has:
        q = np.zeros((1, 1, 2, 4), np.float32)
        with pytest.raises(NotImplementedError, match="rope_jit_attention"):
            rope_jit.attention(q, q, q, np.empty_like(q), runtime=cpu_runtime)


def test_stats_holds_only_the_counters_the_loaded_library_has(library):
    # A library from before disk_evictions leaves that field of a newer caller's struct
    # unwritten: stats() leaves it out rather than report 0 for it.
    with rope_jit.Runtime(backend="cpu", disk_cache=False) as runtime:
        assert "disk_evictions" in runtime.stats()
        older = rope_jit._library.Library(library.cdll, library.path)
        older.new_struct(_structs.Stats, older.rope_jit_stats_init)
        older.struct_sizes["Stats"] = _structs.Stats.disk_evictions.offset
        runtime._library = older
        stats = runtime.stats()
        assert "disk_evictions" not in stats and "module_load_ms" in stats


def test_arguments_past_an_older_librarys_rope_args_are_refused_rather_than_ignored(library, cpu_runtime):
    # A library from before learned frequencies and M-RoPE: its rope_jit_rope_args ends where
    # inv_freq_grad would start. Which fields it has is looked up once and cached per library.
    older = rope_jit._library.Library(library.cdll, library.path)
    older.new_struct(_structs.RopeArgs, older.rope_jit_rope_args_init)
    older.struct_sizes["RopeArgs"] = _structs.RopeArgs.mrope_sections.offset
    runtime = type("OlderRuntime", (), {
        "library": older,
        "handle": cpu_runtime.handle,
        "_call": lambda self, function, *args: function(self.handle, *args),
    })()
    q = np.zeros((1, 2, 3, 8), np.float32)
    inv_freq = np.ones(4, np.float32)
    for _ in range(2):  # the first call fills the cache, the second reads it
        with pytest.raises(NotImplementedError, match=r"^mrope_sections: the loaded librope_jit .* too old"):
            rope_jit.rope(q, inv_freq=inv_freq, positions=np.zeros((3, 3), np.int64), mrope_sections=[2, 1, 1],
                          runtime=runtime)
        with pytest.raises(NotImplementedError, match=r"^inv_freq_grad: the loaded librope_jit .* too old"):
            rope_jit.rope(q, inv_freq=inv_freq, backward=True, inv_freq_grad=np.zeros(4, np.float32),
                          runtime=runtime)
    rope_jit.rope(q, inv_freq=inv_freq, runtime=runtime)  # what it has still works


def test_prewarm_json_takes_the_cache_vocabulary_and_names_a_bad_field(library, tmp_path):
    with rope_jit.Runtime(backend="cpu", cache_dir=tmp_path) as runtime:
        with pytest.raises(rope_jit.InvalidArgumentError) as caught:
            runtime.prewarm_json([{"head_dim": 64}, {"head_dim": 64, "direction": "sideways"}], target="sm_90")
        assert "json[1]: direction" in caught.value.detail
        with pytest.raises(rope_jit.InvalidArgumentError) as caught:
            runtime.prewarm_json({"head_dim": 64}, target="sm_9")
        assert "target" in caught.value.detail
        # A NUL would end the C string early: "sm_90\0x" ran as sm_90 (adversarial test).
        with pytest.raises(ValueError, match="target: contains a NUL"):
            runtime.prewarm_json({"head_dim": 64}, target="sm_90\0x")
        assert runtime.stats()["compiles"] == 0


def test_prewarm_without_a_disk_cache_warns_that_it_keeps_nothing(library, capfd):
    # rope_jit.h promises one warning for kernels a prewarm cannot store; without a disk
    # cache there was none (review, session 39).
    with rope_jit.Runtime(backend="cpu", disk_cache=False) as runtime:
        try:
            runtime.prewarm([{"head_dim": 40}], target="sm_90")
        except rope_jit.BackendUnavailableError:
            pytest.skip("no NVRTC to compile with")
        assert runtime.stats()["compiles"] == 1 and runtime.stats()["disk_writes"] == 0
    warnings = [line for line in capfd.readouterr().err.splitlines()
                if "warning" in line and "no disk cache" in line]  # (others may come: NVRTC's)
    assert len(warnings) == 1, warnings


def test_programmatic_launch_none_keeps_the_library_default_and_booleans_set_it(library,
                                                                                monkeypatch):
    # What each argument hands rope_jit_runtime_create: None the library's default (AUTO, -1:
    # programmatic where the GPU and driver take them), True ON (1), False OFF (0).
    monkeypatch.delenv("ROPE_JIT_PROGRAMMATIC_LAUNCH", raising=False)
    create = library.rope_jit_runtime_create
    passed = []

    def spy(config, out):
        passed.append(config._obj.programmatic_launch)
        return create(config, out)

    monkeypatch.setattr(library, "rope_jit_runtime_create", spy)
    for programmatic in (None, True, False):
        with rope_jit.Runtime(backend="cpu", disk_cache=False, programmatic_launch=programmatic):
            pass
    assert passed == [-1, 1, 0]  # rope_jit.h: ROPE_JIT_PROGRAMMATIC_AUTO, _ON, _OFF
    # The C values are not accepted for the booleans (-1 would read as True).
    for value in (-1, 1, "auto"):
        with pytest.raises(TypeError, match="programmatic_launch"):
            rope_jit.Runtime(backend="cpu", disk_cache=False, programmatic_launch=value)
    assert passed == [-1, 1, 0]  # refused before the library saw them


def test_programmatic_launch_true_is_refused_by_a_library_from_before_the_field(library, monkeypatch):
    # The field took the struct's old tail padding, so struct_size cannot tell such a library;
    # its init leaves the field 0 where one that has it writes AUTO (-1). True was ignored
    # there (left out in session 43); False and None ask for what it does anyway.
    older = rope_jit._library.Library(library.cdll, library.path)

    def init_before_the_field(config):
        library.rope_jit_config_init(config)
        offset = _structs.Config.programmatic_launch.offset
        ctypes.c_int.from_address(ctypes.addressof(config.contents) + offset).value = 0

    older.rope_jit_config_init = init_before_the_field
    monkeypatch.setattr(rope_jit._library, "load", lambda: older)
    for _ in range(2):  # the first call fills the cache, the second reads it
        with pytest.raises(NotImplementedError, match=r"^programmatic_launch: the loaded librope_jit .* too old"):
            rope_jit.Runtime(backend="cpu", disk_cache=False, programmatic_launch=True)
    for programmatic in (None, False):
        with rope_jit.Runtime(backend="cpu", disk_cache=False, programmatic_launch=programmatic):
            pass
    assert "programmatic_launch" not in older.fields(_structs.Config, older.rope_jit_config_init)
    assert "programmatic_launch" in library.fields(_structs.Config, library.rope_jit_config_init)


def test_programmatic_launch_is_accepted_and_changes_no_cpu_result(library):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, 5, 8)).astype(np.float32)
    cos = rng.standard_normal((5, 4)).astype(np.float32)
    sin = rng.standard_normal((5, 4)).astype(np.float32)
    outputs = []
    for programmatic in (False, True, None):
        with rope_jit.Runtime(backend="cpu", disk_cache=False, programmatic_launch=programmatic) as runtime:
            x = q.copy()
            rope_jit.rope(x, cos=cos, sin=sin, runtime=runtime)
            outputs.append(x)
    assert not np.array_equal(outputs[0], q)
    assert np.array_equal(outputs[0], outputs[1])
    assert np.array_equal(outputs[0], outputs[2])
