//! Build script of `mlxcel-core`: locates MLX's C++ library, generates the op table, compiles the
//! C++ shim through `cxx`, and links `libmlx` so that any binary depending on any mlxcel crate
//! finds it at run time without a build script of its own (see [`LinkMode`]).
//!
//! MLX is found in this order (see README "Getting MLX"):
//! 1. `MLX_DIR`: a folder holding `mlx/lib/libmlx.{so,dylib}` and `mlx/include`;
//! 2. an importable Python `mlx` (a namespace package: every entry of `mlx.__path__` is tried);
//! 3. the `mlx-cpu` wheel from PyPI, pip-downloaded (no deps; never when `CARGO_NET_OFFLINE=true`
//!    or `MLXCEL_OFFLINE=1`) and unpacked into a cache folder
//!    (`MLXCEL_CACHE_DIR`, else `$HOME/.cache/mlxcel`), keeping `mlx/` and `mlx_cpu.libs/` side by
//!    side because `libmlx.so` finds its BLAS through `$ORIGIN/../../mlx_cpu.libs`.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const MLX_VERSION: &str = "0.32.4";

fn main() {
    println!("cargo:rerun-if-env-changed=MLX_DIR");
    println!("cargo:rerun-if-env-changed=MLXCEL_CACHE_DIR");
    println!("cargo:rerun-if-env-changed=MLXCEL_PYTHON");
    println!("cargo:rerun-if-env-changed=MLXCEL_LINK");
    println!("cargo:rerun-if-env-changed=DOCS_RS");
    println!("cargo:rerun-if-env-changed=CARGO_NET_OFFLINE");
    println!("cargo:rerun-if-env-changed=MLXCEL_OFFLINE");
    println!("cargo:rerun-if-changed=ops.table");
    println!("cargo:rerun-if-changed=cpp/shim.h");
    println!("cargo:rerun-if-changed=cpp/shim.cc");
    println!("cargo:rerun-if-changed=cpp/cpu_linear.cc");
    println!("cargo:rerun-if-changed=cpp/cpu_linear_kernels.inc");
    println!("cargo:rerun-if-changed=cpp/cpu_gemv_avx512.inc");
    println!("cargo:rerun-if-changed=cpp/cpu_attention.cc");
    println!("cargo:rerun-if-changed=cpp/cpu_scan.cc");
    println!("cargo:rerun-if-changed=cpp/cpu_decode.cc");
    println!("cargo:rerun-if-changed=cpp/cpu_decode_kernels.inc");
    println!("cargo:rerun-if-changed=cpp/cuda_compile.cc");
    println!("cargo:rerun-if-changed=cpp/cuda_launch.cc");
    println!("cargo:rerun-if-changed=cpp/cuda_decode.cc");
    println!("cargo:rerun-if-changed=cpp/cuda_load.cc");
    println!("cargo:rerun-if-changed=cpp/cuda_emulation.cc");
    println!("cargo:rerun-if-changed=kernels/cuda/rows.cu");
    println!("cargo:rerun-if-changed=cpp/cuda_api.h");
    println!("cargo:rerun-if-changed=cpp/cpu_kernels.h");
    println!("cargo:rerun-if-changed=cpp/cpu_vec_math.inc");
    println!("cargo:rerun-if-changed=cpp/cpu_gemm_kernels.inc");
    println!("cargo:rerun-if-changed=cpp/cpu_attention_kernels.inc");
    println!("cargo:rerun-if-changed=src/ffi.rs");

    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    generate_prebuilt_cubins(&out);
    if env::var_os("DOCS_RS").is_some() {
        // Documentation builds neither compile the C++ shim nor link: no MLX needed.
        generate_op_table(&out);
        println!("cargo:rustc-env=MLXCEL_MLX_LIB_DIR=");
        return;
    }
    let root = match locate_mlx() {
        Ok(root) => root,
        Err(why) => {
            eprintln!("mlxcel-core: could not find MLX {MLX_VERSION}: {why}");
            eprintln!("  set MLX_DIR to a folder holding mlx/lib/libmlx.so and mlx/include,");
            eprintln!(
                "  or `pip install mlx-cpu=={MLX_VERSION}` (Linux) / `pip install mlx` (macOS)"
            );
            std::process::exit(1);
        }
    };
    let include = root.join("mlx").join("include");
    let lib = root.join("mlx").join("lib");
    check_version(&include);

    generate_op_table(&out);

    let mut build = cxx_build::bridge("src/ffi.rs");
    build
        // Optimised in every profile: the CPU linear kernel is the hot loop of CPU inference and
        // tests (debug builds of the workspace would otherwise compile it at -O0).
        .opt_level(2)
        .file("cpp/shim.cc")
        .file("cpp/cpu_linear.cc")
        .file("cpp/cpu_attention.cc")
        .file("cpp/cpu_scan.cc")
        .file("cpp/cpu_decode.cc")
        .file("cpp/cuda_compile.cc")
        .file("cpp/cuda_launch.cc")
        .file("cpp/cuda_decode.cc")
        .file("cpp/cuda_load.cc")
        .file("cpp/cuda_emulation.cc")
        .include(&include)
        .include(&out)
        .flag_if_supported("-std=c++20")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        .flag_if_supported("-Wno-unused-variable")
        .flag_if_supported("-Wno-sign-compare")
        .flag_if_supported("-Wno-psabi");
    if env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("macos") {
        build.flag("-mmacosx-version-min=14.0");
    }
    build.compile("mlxcel_shim");

    let linux = env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux");
    match LinkMode::from_env(linux) {
        LinkMode::Path => {
            let link_dir = link_by_path(&root, &out).unwrap_or_else(|why| {
                eprintln!("mlxcel-core: preparing libmlx for linking by path: {why}");
                std::process::exit(1);
            });
            println!("cargo:rustc-link-search=native={}", link_dir.display());
            println!("cargo:rustc-link-lib=dylib={LINKER_SCRIPT_LIB}");
        }
        LinkMode::Name => {
            println!("cargo:rustc-link-search=native={}", lib.display());
            println!("cargo:rustc-link-lib=dylib=mlx");
            // This crate's own tests and examples: a RUNPATH (LD_LIBRARY_PATH still wins).
            println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
            if linux {
                println!("cargo:rustc-link-arg=-Wl,--enable-new-dtags");
            }
        }
    }
    if linux {
        // dlsym for the CUDA entry points (cpp/cuda_compile.cc); part of libc on newer glibc.
        println!("cargo:rustc-link-lib=dylib=dl");
    }
    // Exposed to dependents as DEP_MLX_LIB_DIR / DEP_MLX_INCLUDE_DIR.
    println!("cargo:lib_dir={}", lib.display());
    println!("cargo:include_dir={}", include.display());
    println!("cargo:rustc-env=MLXCEL_MLX_LIB_DIR={}", lib.display());
}

/// How binaries record their dependency on `libmlx` (`MLXCEL_LINK`).
///
/// Cargo passes a dependency's link *libraries* on to every binary that uses it, but not its
/// link *arguments* (a RUNPATH), so a program depending on an mlxcel crate could not find
/// `libmlx.so` at run time without a build script of its own.
#[derive(Clone, Copy, PartialEq, Eq)]
enum LinkMode {
    /// Default on Linux: binaries record `libmlx` by absolute path. The build links a copy of
    /// the library without its SONAME (kept beside MLX's other folders through symlinks, so its
    /// own `$ORIGIN` RPATH still finds its BLAS) through a one-line linker script; the linker
    /// then records the copy's path as the dependency. Nothing to set at run time.
    Path,
    /// `MLXCEL_LINK=name` (and macOS): binaries record `libmlx.so` by name and find it through
    /// `LD_LIBRARY_PATH` or a RUNPATH of their own. For relocatable binaries (library beside the
    /// executable, `-C link-arg=-Wl,-rpath,$ORIGIN/mlx/lib`) and for swapping in the CUDA build
    /// of the same MLX version with `LD_LIBRARY_PATH`.
    Name,
}

impl LinkMode {
    fn from_env(linux: bool) -> LinkMode {
        match env::var("MLXCEL_LINK").as_deref() {
            Ok("name") => LinkMode::Name,
            Ok("path") | Ok("") | Err(_) if linux => LinkMode::Path,
            Ok("path") | Ok("") | Err(_) => LinkMode::Name,
            Ok(other) => {
                eprintln!("mlxcel-core: MLXCEL_LINK={other}: expected `path` or `name`");
                std::process::exit(1);
            }
        }
    }
}

/// The library name the linker script is found under (`-lmlxcel_mlx`). Not `mlx`: cargo puts
/// link-search folders on `LD_LIBRARY_PATH` when it runs binaries and tests, and a text file
/// named `libmlx.so` there would shadow the real library for other programs they start (Python's
/// `mlx`, for one).
const LINKER_SCRIPT_LIB: &str = "mlxcel_mlx";

/// Prepares `out/mlx-link/`: a mirror of the MLX installation at `root` (symlinks) whose
/// `mlx/lib/libmlx.so` is a copy without `DT_SONAME`, and `ld/libmlxcel_mlx.so`, a linker
/// script naming that copy by absolute path. Returns the folder to search for the script.
fn link_by_path(root: &Path, out: &Path) -> Result<PathBuf, String> {
    let mirror = out.join("mlx-link");
    let _ = fs::remove_dir_all(&mirror);
    let lib_dir = mirror.join("mlx").join("lib");
    fs::create_dir_all(&lib_dir).map_err(|e| format!("{}: {e}", lib_dir.display()))?;
    let link = |from: &Path, to: &Path| -> Result<(), String> {
        std::os::unix::fs::symlink(from, to).map_err(|e| format!("{}: {e}", to.display()))
    };
    let entries = |dir: &Path| -> Result<Vec<PathBuf>, String> {
        Ok(fs::read_dir(dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect())
    };
    // Everything beside `mlx/` (e.g. `mlx_cpu.libs/`), beside `mlx/lib/`, and in `mlx/lib/`
    // except libmlx itself, so relative RPATHs resolve as in the original installation.
    for (from, to) in [
        (root.to_path_buf(), mirror.clone()),
        (root.join("mlx"), mirror.join("mlx")),
        (root.join("mlx").join("lib"), lib_dir.clone()),
    ] {
        for entry in entries(&from)? {
            let name = entry.file_name().unwrap_or_default();
            if to.join(name).exists() || name == "libmlx.so" {
                continue;
            }
            link(&entry, &to.join(name))?;
        }
    }
    let original = root.join("mlx").join("lib").join("libmlx.so");
    let mut bytes = fs::read(&original).map_err(|e| format!("{}: {e}", original.display()))?;
    remove_soname(&mut bytes).map_err(|e| format!("{}: {e}", original.display()))?;
    let copy = lib_dir.join("libmlx.so");
    fs::write(&copy, bytes).map_err(|e| format!("{}: {e}", copy.display()))?;
    let ld = mirror.join("ld");
    fs::create_dir_all(&ld).map_err(|e| format!("{}: {e}", ld.display()))?;
    let script = ld.join(format!("lib{LINKER_SCRIPT_LIB}.so"));
    fs::write(&script, format!("INPUT({})\n", copy.display()))
        .map_err(|e| format!("{}: {e}", ld.display()))?;
    Ok(ld)
}

/// Removes the `DT_SONAME` entry from a 64-bit little-endian ELF shared object's dynamic
/// section (the following entries move up; the section keeps its size and terminator).
fn remove_soname(elf: &mut [u8]) -> Result<(), String> {
    const PT_DYNAMIC: u32 = 2;
    const DT_NULL: u64 = 0;
    const DT_SONAME: u64 = 14;
    let u16_at = |b: &[u8], o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as usize;
    let u32_at = |b: &[u8], o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap_or([0; 4]));
    let u64_at = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap_or([0; 8]));
    if elf.len() < 64 || &elf[..4] != b"\x7fELF" || elf[4] != 2 || elf[5] != 1 {
        return Err("not a 64-bit little-endian ELF file".into());
    }
    let (phoff, phentsize, phnum) = (u64_at(elf, 32) as usize, u16_at(elf, 54), u16_at(elf, 56));
    let dynamic = (0..phnum)
        .map(|i| phoff + i * phentsize)
        .find(|&h| h + 56 <= elf.len() && u32_at(elf, h) == PT_DYNAMIC)
        .ok_or("no dynamic section")?;
    let (start, size) = (
        u64_at(elf, dynamic + 8) as usize,
        u64_at(elf, dynamic + 32) as usize,
    );
    if start + size > elf.len() {
        return Err("dynamic section past the end of the file".into());
    }
    let count = size / 16;
    let tag = |b: &[u8], i: usize| u64_at(b, start + i * 16);
    let Some(soname) = (0..count).find(|&i| tag(elf, i) == DT_SONAME) else {
        return Ok(());
    };
    let end = (0..count)
        .find(|&i| tag(elf, i) == DT_NULL)
        .unwrap_or(count - 1);
    elf.copy_within(
        start + (soname + 1) * 16..start + (end + 1) * 16,
        start + soname * 16,
    );
    elf[start + end * 16..start + (end + 1) * 16].fill(0);
    Ok(())
}

fn has_mlx(root: &Path) -> bool {
    let lib = root.join("mlx").join("lib");
    (lib.join("libmlx.so").is_file() || lib.join("libmlx.dylib").is_file())
        && root
            .join("mlx")
            .join("include")
            .join("mlx")
            .join("mlx.h")
            .is_file()
}

fn locate_mlx() -> Result<PathBuf, String> {
    if let Ok(dir) = env::var("MLX_DIR") {
        let dir = PathBuf::from(dir);
        return if has_mlx(&dir) {
            Ok(dir)
        } else {
            Err(format!(
                "MLX_DIR={} holds no mlx/lib/libmlx.so with mlx/include",
                dir.display()
            ))
        };
    }
    let python = env::var("MLXCEL_PYTHON").unwrap_or_else(|_| "python3".to_string());
    if let Some(root) = python_mlx(&python) {
        return Ok(root);
    }
    download_wheel(&python)
}

/// The parent of every `mlx` package folder Python can import, first one holding the C++ library.
fn python_mlx(python: &str) -> Option<PathBuf> {
    let output = Command::new(python)
        .args(["-c", "import mlx\nfor p in mlx.__path__: print(p)"])
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| Path::new(line.trim()).parent().map(Path::to_path_buf))
        .find(|root| has_mlx(root))
}

fn download_wheel(python: &str) -> Result<PathBuf, String> {
    let cache = match env::var("MLXCEL_CACHE_DIR") {
        Ok(dir) => PathBuf::from(dir),
        Err(_) => PathBuf::from(env::var("HOME").map_err(|_| "HOME is not set".to_string())?)
            .join(".cache")
            .join("mlxcel"),
    };
    let root = cache.join(format!("mlx-cpu-{MLX_VERSION}"));
    if has_mlx(&root) {
        return Ok(root);
    }
    // Offline builds never reach for the network (`CARGO_NET_OFFLINE=true`, as cargo's own
    // setting is spelled in the environment, or `MLXCEL_OFFLINE=1`).
    let offline = env::var("CARGO_NET_OFFLINE").is_ok_and(|v| v == "true")
        || env::var("MLXCEL_OFFLINE").is_ok_and(|v| v == "1");
    if offline {
        return Err(format!(
            "offline build and no MLX in {}, MLX_DIR or Python: it would be downloaded from PyPI",
            root.display()
        ));
    }
    let download = cache.join(format!("mlx-cpu-{MLX_VERSION}-download"));
    let _ = fs::remove_dir_all(&download);
    fs::create_dir_all(&download).map_err(|e| format!("{}: {e}", download.display()))?;
    let status = Command::new(python)
        .args(["-m", "pip", "download", "--quiet", "--no-deps", "-d"])
        .arg(&download)
        .arg(format!("mlx-cpu=={MLX_VERSION}"))
        .status()
        .map_err(|e| format!("running {python} -m pip: {e}"))?;
    if !status.success() {
        return Err(format!("`pip download mlx-cpu=={MLX_VERSION}` failed"));
    }
    let wheel = fs::read_dir(&download)
        .map_err(|e| format!("{}: {e}", download.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|ext| ext == "whl"))
        .ok_or_else(|| format!("no wheel in {}", download.display()))?;
    // Unpack into a staging folder and rename, so an interrupted build never leaves half a library.
    let staging = cache.join(format!("mlx-cpu-{MLX_VERSION}-staging"));
    let _ = fs::remove_dir_all(&staging);
    let status = Command::new(python)
        .args(["-m", "zipfile", "-e"])
        .arg(&wheel)
        .arg(&staging)
        .status()
        .map_err(|e| format!("unpacking {}: {e}", wheel.display()))?;
    if !status.success() || !has_mlx(&staging) {
        return Err(format!("unpacking {} failed", wheel.display()));
    }
    let _ = fs::remove_dir_all(&root);
    fs::rename(&staging, &root).map_err(|e| format!("{}: {e}", root.display()))?;
    let _ = fs::remove_dir_all(&download);
    Ok(root)
}

fn check_version(include: &Path) {
    let header = include.join("mlx").join("version.h");
    let Ok(text) = fs::read_to_string(&header) else {
        return;
    };
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("#define {name} ")))
            .map(|v| v.trim().to_string())
    };
    let found = format!(
        "{}.{}.{}",
        field("MLX_VERSION_MAJOR").unwrap_or_default(),
        field("MLX_VERSION_MINOR").unwrap_or_default(),
        field("MLX_VERSION_PATCH").unwrap_or_default()
    );
    if found != MLX_VERSION {
        println!(
            "cargo:warning=mlxcel is built and tested against MLX {MLX_VERSION}; found {found} at {}",
            header.display()
        );
    }
}

/// Reads `ops.table` (one op per line: `family rust_name mlx_function doc...`) and writes the C++
/// dispatch tables (`ops_table.inc`) and the Rust methods (`ops_table.rs`) from it, so adding an op
/// of an existing family is one line in one file.
fn generate_op_table(out: &Path) {
    let table = fs::read_to_string("ops.table").expect("ops.table is part of the crate");
    let mut cpp: [String; 3] = Default::default();
    let mut rust = String::from("impl Array {\n");
    for (lineno, line) in table.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut words = line.split_whitespace();
        let family = words.next().unwrap_or_default();
        let name = words.next().unwrap_or_default();
        let mlx = words.next().unwrap_or_default();
        let doc = words.collect::<Vec<_>>().join(" ");
        assert!(
            !name.is_empty() && !mlx.is_empty(),
            "ops.table:{}: expected `family name mlx_function doc`",
            lineno + 1
        );
        let doc = if doc.is_empty() {
            format!("MLX `{mlx}`.")
        } else {
            doc
        };
        let (slot, entry, method) = match family {
            "unary" => (
                0,
                format!("  {{\"{name}\", [](const array& a) {{ return {mlx}(a); }}}},\n"),
                format!(
                    "    /// {doc}\n    pub fn {name}(&self) -> Result<Array> {{\n        self.unary_op(\"{name}\")\n    }}\n"
                ),
            ),
            "binary" => (
                1,
                format!(
                    "  {{\"{name}\", [](const array& a, const array& b) {{ return {mlx}(a, b); }}}},\n"
                ),
                format!(
                    "    /// {doc}\n    pub fn {name}(&self, other: &Array) -> Result<Array> {{\n        self.binary_op(\"{name}\", other)\n    }}\n"
                ),
            ),
            "reduce" => (
                2,
                format!(
                    "  {{\"{name}\", [](const array& a, const std::vector<int>& axes, bool keepdims) {{ return {mlx}(a, axes, keepdims); }}}},\n"
                ),
                format!(
                    "    /// {doc} Reduces over `axes` (negative counts from the end).\n    pub fn {name}(&self, axes: &[i32], keepdims: bool) -> Result<Array> {{\n        self.reduce_op(\"{name}\", axes, keepdims)\n    }}\n"
                ),
            ),
            other => panic!("ops.table:{}: unknown family `{other}`", lineno + 1),
        };
        cpp[slot].push_str(&entry);
        rust.push_str(&method);
    }
    rust.push_str("}\n");
    let mut inc = String::new();
    let names = ["UNARY_OPS", "BINARY_OPS", "REDUCE_OPS"];
    let types = ["UnaryFn", "BinaryFn", "ReduceFn"];
    for (i, entries) in cpp.iter().enumerate() {
        let _ = write!(
            inc,
            "static const std::unordered_map<std::string, {}> {} = {{\n{}}};\n",
            types[i], names[i], entries
        );
    }
    fs::write(out.join("ops_table.inc"), inc).expect("write ops_table.inc");
    fs::write(out.join("ops_table.rs"), rust).expect("write ops_table.rs");
}

/// `prebuilt_cubins.rs`: every `kernels/prebuilt/*.cubin` (mlxcel's CUDA kernels compiled on a
/// GPU machine, named `{kernel}-sm{arch}-{source fingerprint}.cubin` like the disk cache) as
/// `(file name, bytes)`, so a fresh machine's first process need not compile them.
fn generate_prebuilt_cubins(out: &std::path::Path) {
    let dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"))
        .join("kernels")
        .join("prebuilt");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "cubin"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    let mut code = String::from("/// Generated by build.rs from kernels/prebuilt/.\n");
    code += "pub(crate) static PREBUILT_CUBINS: &[(&str, &[u8])] = &[\n";
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
        let name = f
            .file_name()
            .and_then(|n| n.to_str())
            .expect("a UTF-8 file name");
        code += &format!(
            "    ({name:?}, include_bytes!({:?})),\n",
            f.display().to_string()
        );
    }
    code += "];\n";
    std::fs::write(out.join("prebuilt_cubins.rs"), code).expect("write prebuilt_cubins.rs");
}
