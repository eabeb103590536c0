//! Compiled custom kernels kept between runs, through MLX's own on-disk cache of
//! compiled CUDA modules.
//!
//! MLX compiles every variant of a custom kernel (each set of template constants is a
//! source of its own) with NVRTC when it first runs, and keeps the module in memory
//! only: for custom kernels it never writes its disk cache. It does *read* that cache
//! for them: before compiling a module it looks for `<MLX_PTX_CACHE_DIR>/<module>.ptx`
//! (the compiled binary) and `<module>.txt` (kernel name, tab, lowered name). So this
//! module writes those files itself: when a variant is first seen in a process
//! ([`note_variant`], called by [`super::fast::CudaKernel::call`]), it takes the op's
//! name and generated source from MLX (`CustomKernel::state`), names the module as
//! MLX does (`<kernel name>_<std::hash of the source>`), and if no valid entry exists
//! compiles the same source with NVRTC on a background thread (the headers MLX
//! includes replaced by the few that the kernels need, the options MLX uses) and writes
//! the entry. An evaluation waits for the compilations still pending among the variants
//! its thread launched since its last evaluation ([`wait_pending`]), so MLX finds their
//! entries instead of compiling again, and compilations it does not need (started for
//! steps not run yet: [`take_needed`], put back with [`set_needed`] for the step that
//! runs) go on in the background; the variants of one
//! step compile in parallel.
//!
//! Entries are keyed by the module name (which hashes the whole source, template
//! constants included) inside a folder per MLX version, GPU architecture and NVRTC
//! version (chosen by the caller). Each entry has a `<module>.sum` beside it (sizes and
//! FNV-1a hashes of the binary and the name file); an entry whose files do not match
//! it, or that has none (written by someone else, or cut short), is rebuilt before MLX
//! reads it. Where anything fails (no NVRTC, a compile error, an unwritable folder),
//! MLX compiles the variant itself as it always did.
use std::cell::RefCell;
use std::collections::HashSet;
use std::ffi::OsString;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use super::ffi::ffi;
use super::Array;

/// How entries are compiled and where they live.
#[derive(Debug, Clone)]
pub struct Config {
    /// MLX's `MLX_PTX_CACHE_DIR` (the caller sets the variable to it).
    pub dir: PathBuf,
    /// The NVRTC library to load (empty: the one MLX loaded, else the loader's search).
    pub nvrtc: String,
    /// NVRTC options (architecture, include paths), as MLX passes them.
    pub options: Vec<String>,
    /// Whether NVRTC emits a cubin (else PTX), as MLX decides for the GPU.
    pub cubin: bool,
    /// Compilations running at once.
    pub jobs: usize,
    /// A command (program and arguments) that compiles one kernel in a process of its own
    /// ([`serve_worker`] on the other side); `None`: in this process. NVRTC compiles one
    /// program at a time per process (its threads wait for each other), so only worker
    /// processes compile `jobs` kernels at once.
    pub worker: Option<Vec<OsString>>,
}

/// What the cache did in this process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Variants whose entry was there and valid.
    pub hits: u64,
    /// Variants compiled and written.
    pub built: u64,
    /// Entries found invalid (and rebuilt).
    pub invalid: u64,
    /// Variants that could not be compiled or written (MLX compiled them).
    pub failed: u64,
}

/// The end of a compilation job: frees its compile slot, then its pending entry (the
/// entry is written by then), waking whoever waits for either.
struct JobEnd {
    pending: Arc<(Mutex<HashSet<u64>>, Condvar)>,
    fast: Arc<AtomicUsize>,
    key: u64,
    /// set once the job holds a compile slot
    running: Option<Arc<(Mutex<usize>, Condvar)>>,
}

impl Drop for JobEnd {
    fn drop(&mut self) {
        if let Some(running) = &self.running {
            let (m, cv) = &**running;
            *m.lock().unwrap_or_else(PoisonError::into_inner) -= 1;
            cv.notify_one();
        }
        let (m, cv) = &*self.pending;
        m.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.key);
        self.fast.fetch_sub(1, Ordering::SeqCst);
        cv.notify_all();
    }
}

/// The header line MLX puts at the top of every custom kernel's source; its headers
/// are compiled into MLX and unavailable to NVRTC outside it.
const MLX_UTILS_INCLUDE: &str = "#include \"mlx/backend/cuda/device/utils.cuh\"";

/// What the kernels need of those headers: the 16-bit float types, fixed-width integers,
/// and the `Shape` / `Strides` parameters MLX passes when a body names `<input>_shape`
/// (`cuda::std::array` of `MAX_NDIM` = 10 values there; the same bytes here).
/// Cooperative groups come from the CUDA headers, as MLX includes them.
pub const PRELUDE: &str = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n\
typedef signed char int8_t;\ntypedef unsigned char uint8_t;\ntypedef short int16_t;\n\
typedef unsigned short uint16_t;\ntypedef int int32_t;\ntypedef unsigned int uint32_t;\n\
typedef long long int64_t;\ntypedef unsigned long long uint64_t;\n\
namespace mlx::core::cu {\n\
struct Shape { int32_t v[10]; __device__ int32_t operator[](int i) const { return v[i]; } };\n\
struct Strides { int64_t v[10]; __device__ int64_t operator[](int i) const { return v[i]; } };\n\
}\n";

/// The compiler the cache runs: source, file name, kernel name expression → (binary,
/// lowered name). NVRTC in production; tests pass another.
pub type Compiler = dyn Fn(&str, &str, &str) -> Result<(Vec<u8>, String), String> + Send + Sync;

/// One cache folder and its bookkeeping.
pub struct Cache {
    dir: PathBuf,
    compiler: Arc<Compiler>,
    jobs: usize,
    seen: Mutex<HashSet<u64>>,
    /// the launch keys of the compilations started and not finished; the condition
    /// variable is notified as each finishes
    pending: Arc<(Mutex<HashSet<u64>>, Condvar)>,
    pending_fast: Arc<AtomicUsize>,
    running: Arc<(Mutex<usize>, Condvar)>,
    hits: AtomicU64,
    built: Arc<AtomicU64>,
    invalid: AtomicU64,
    failed: Arc<AtomicU64>,
}

impl Cache {
    pub fn new(dir: PathBuf, jobs: usize, compiler: Arc<Compiler>) -> Cache {
        Cache {
            dir,
            compiler,
            jobs: jobs.max(1),
            seen: Mutex::new(HashSet::new()),
            pending: Arc::new((Mutex::new(HashSet::new()), Condvar::new())),
            pending_fast: Arc::new(AtomicUsize::new(0)),
            running: Arc::new((Mutex::new(0), Condvar::new())),
            hits: AtomicU64::new(0),
            built: Arc::new(AtomicU64::new(0)),
            invalid: AtomicU64::new(0),
            failed: Arc::new(AtomicU64::new(0)),
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn stats(&self) -> Stats {
        Stats {
            hits: self.hits.load(Ordering::Relaxed),
            built: self.built.load(Ordering::Relaxed),
            invalid: self.invalid.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
        }
    }

    /// Whether `key` (a variant's launch key) is new to this process; marks it seen.
    pub fn first_sight(&self, key: u64) -> bool {
        self.seen.lock().map(|mut s| s.insert(key)).unwrap_or(false)
    }

    /// Whether the compilation of the variant with launch key `key` is under way.
    pub fn is_pending(&self, key: u64) -> bool {
        self.pending_fast.load(Ordering::SeqCst) > 0
            && self.pending.0.lock().is_ok_and(|p| p.contains(&key))
    }

    /// Make sure the module of kernel `id` (launch key `key`) has a valid entry: nothing
    /// when it has, else (after removing a bad one) a compilation on a background thread,
    /// which [`Cache::wait`] and [`Cache::wait_for`] wait for. Returns whether a
    /// compilation started.
    pub fn ensure(&self, key: u64, id: &ffi::KernelIdentity) -> bool {
        if self.is_pending(key) {
            return true;
        }
        let paths = EntryPaths::new(&self.dir, &id.module_name);
        match paths.check() {
            Entry::Valid => {
                self.hits.fetch_add(1, Ordering::Relaxed);
                return false;
            }
            Entry::Invalid => {
                self.invalid.fetch_add(1, Ordering::Relaxed);
                paths.remove();
            }
            Entry::Missing => {}
        }
        let Some(source) = compile_source(&id.source) else {
            tracing::debug!(
                "kernel cache: {} has no `{MLX_UTILS_INCLUDE}` line; MLX compiles it",
                id.kernel_name
            );
            self.failed.fetch_add(1, Ordering::Relaxed);
            return false;
        };
        let name_expr = format!("mlx::core::cu::{}", id.kernel_name);
        let file = format!("{}.cu", id.module_name);
        let (compiler, built, failed) = (
            self.compiler.clone(),
            self.built.clone(),
            self.failed.clone(),
        );
        let (pending, fast, running, jobs) = (
            self.pending.clone(),
            self.pending_fast.clone(),
            self.running.clone(),
            self.jobs,
        );
        if !pending.0.lock().unwrap().insert(key) {
            // (already compiling: a second `ensure` of the key waits for the first)
            return true;
        }
        fast.fetch_add(1, Ordering::SeqCst);
        // however the job ends (a panic included, or dropped unrun where no thread could
        // be started), its slot and pending entry go
        let end = JobEnd {
            pending,
            fast,
            key,
            running: None,
        };
        let job = move || {
            // (the whole guard moves into the job: it ends with the job)
            let mut end = end;
            {
                // at most `jobs` compilations at once
                let (m, cv) = &*running;
                let mut n = cv
                    .wait_while(m.lock().unwrap_or_else(PoisonError::into_inner), |n| {
                        *n >= jobs
                    })
                    .unwrap_or_else(PoisonError::into_inner);
                *n += 1;
            }
            end.running = Some(running);
            let t0 = std::time::Instant::now();
            let result = compiler(&source, &file, &name_expr).and_then(|(bin, lowered)| {
                paths
                    .write(&bin, &format!("{name_expr}\t{lowered}\n"))
                    .map_err(|e| format!("writing {}: {e}", paths.ptx.display()))
            });
            match result {
                Ok(()) => {
                    built.fetch_add(1, Ordering::Relaxed);
                    // (a compilation while requests stream stalls the steps that need it)
                    tracing::debug!(
                        secs = t0.elapsed().as_secs_f64(),
                        "kernel cache: compiled {name_expr}"
                    );
                }
                Err(e) => {
                    failed.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("kernel cache: {name_expr}: {e}; MLX compiles it instead");
                }
            }
        };
        if std::thread::Builder::new()
            .name("kernel-compile".into())
            .spawn(job)
            .is_err()
        {
            self.failed.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Wait until no compilation is pending.
    pub fn wait(&self) {
        if self.pending_fast.load(Ordering::SeqCst) == 0 {
            return;
        }
        let (m, cv) = &*self.pending;
        let _unused = cv.wait_while(m.lock().unwrap(), |p| !p.is_empty()).unwrap();
    }

    /// Wait until none of the variants `keys` is still compiling (others may be).
    pub fn wait_for(&self, keys: &[u64]) {
        if keys.is_empty() || self.pending_fast.load(Ordering::SeqCst) == 0 {
            return;
        }
        let (m, cv) = &*self.pending;
        let _unused = cv
            .wait_while(m.lock().unwrap(), |p| keys.iter().any(|k| p.contains(k)))
            .unwrap();
    }
}

/// The source NVRTC compiles for an entry: MLX's, with its utilities header replaced by
/// [`PRELUDE`]; `None` when the source lacks that header line (another MLX version).
pub fn compile_source(mlx_source: &str) -> Option<String> {
    mlx_source
        .contains(MLX_UTILS_INCLUDE)
        .then(|| mlx_source.replacen(MLX_UTILS_INCLUDE, PRELUDE, 1))
}

enum Entry {
    Valid,
    Invalid,
    Missing,
}

/// An entry's files: where MLX reads them (its `get_ptx_path`: names over 245 bytes are
/// cut into folders of 245), and the check file beside them.
struct EntryPaths {
    ptx: PathBuf,
    txt: PathBuf,
    sum: PathBuf,
}

impl EntryPaths {
    fn new(dir: &Path, module: &str) -> EntryPaths {
        const MAX: usize = 245;
        let mut path = dir.to_path_buf();
        let mut rest = module;
        while rest.len() > MAX {
            let (head, tail) = rest.split_at(MAX);
            path.push(head);
            rest = tail;
        }
        let base = path.join(rest);
        let with = |ext: &str| {
            let mut s = base.clone().into_os_string();
            s.push(ext);
            PathBuf::from(s)
        };
        EntryPaths {
            ptx: with(".ptx"),
            txt: with(".txt"),
            sum: with(".sum"),
        }
    }

    fn check(&self) -> Entry {
        let ptx = match std::fs::read(&self.ptx) {
            Ok(b) => b,
            Err(_) => return Entry::Missing,
        };
        let (Ok(txt), Ok(sum)) = (std::fs::read(&self.txt), std::fs::read_to_string(&self.sum))
        else {
            return Entry::Invalid;
        };
        if sum == check_text(&ptx, &txt) && !ptx.is_empty() {
            Entry::Valid
        } else {
            Entry::Invalid
        }
    }

    fn remove(&self) {
        // the binary first: without it MLX compiles, whatever else is left
        for p in [&self.ptx, &self.sum, &self.txt] {
            let _ = std::fs::remove_file(p);
        }
    }

    /// Write the entry: each file to a temporary name, then renamed into place, the
    /// names file before the binary (MLX reads the binary first and takes its presence
    /// for the entry's) and the check file last.
    fn write(&self, binary: &[u8], names: &str) -> std::io::Result<()> {
        if let Some(parent) = self.ptx.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let put = |path: &Path, bytes: &[u8]| -> std::io::Result<()> {
            let mut tmp = path.as_os_str().to_owned();
            tmp.push(format!(".{}.{nanos}.tmp", std::process::id()));
            let tmp = PathBuf::from(tmp);
            let r = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
            if r.is_err() {
                let _ = std::fs::remove_file(&tmp);
            }
            r
        };
        put(&self.txt, names.as_bytes())?;
        put(&self.ptx, binary)?;
        put(&self.sum, check_text(binary, names.as_bytes()).as_bytes())
    }
}

const FNV_OFFSET: u64 = 0xcbf29ce484222325;

/// FNV-1a of `bytes`, continued from `h`.
fn fnv1a_from(mut h: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        h = (h ^ u64::from(*b)).wrapping_mul(0x100000001b3);
    }
    h
}

fn fnv1a(bytes: &[u8]) -> u64 {
    fnv1a_from(FNV_OFFSET, bytes)
}

fn check_text(binary: &[u8], names: &[u8]) -> String {
    format!(
        "mlxcel kernel cache entry 1\nbinary {} {:016x}\nnames {} {:016x}\n",
        binary.len(),
        fnv1a(binary),
        names.len(),
        fnv1a(names)
    )
}

static CACHE: OnceLock<Cache> = OnceLock::new();

/// Turn the cache on for this process with NVRTC (`cfg`); false if it was on already.
/// The caller sets `MLX_PTX_CACHE_DIR` to `cfg.dir` before MLX compiles anything.
pub fn enable(cfg: Config) -> bool {
    let (lib, options, cubin) = (cfg.nvrtc.clone(), cfg.options.clone(), cfg.cubin);
    let worker = cfg.worker.clone();
    let compiler: Arc<Compiler> = Arc::new(move |src: &str, file: &str, name: &str| {
        let job = CompileJob {
            library: lib.clone(),
            source: src.to_string(),
            file: file.to_string(),
            name_expr: name.to_string(),
            options: options.clone(),
            cubin,
        };
        let in_worker = worker
            .as_ref()
            .filter(|_| !WORKERS_BROKEN.load(Ordering::Relaxed));
        let (binary, lowered) = match in_worker {
            Some(cmd) => match compile_in_worker(cmd, &job, COMPILE_TIMEOUT) {
                Ok(out) => {
                    WORKERS_OK.store(true, Ordering::Relaxed);
                    out
                }
                // compile processes do not work here at all (none ever did): this kernel
                // and the rest compile in this process
                Err(e @ (WorkerError::Start(_) | WorkerError::Broken(_)))
                    if !WORKERS_OK.load(Ordering::Relaxed) =>
                {
                    if !WORKERS_BROKEN.swap(true, Ordering::Relaxed) {
                        tracing::warn!(
                            "kernel cache: a compile process failed ({e}); compiling in this \
                             process from now on"
                        );
                    }
                    job.run()?
                }
                // this kernel's process died or hung (others worked): MLX compiles it
                Err(e) => return Err(e.to_string()),
            },
            None => job.run()?,
        };
        if binary.is_empty() || lowered.is_empty() {
            return Err("NVRTC returned no binary or no lowered name".into());
        }
        Ok((binary, lowered))
    });
    CACHE.set(Cache::new(cfg.dir, cfg.jobs, compiler)).is_ok()
}

/// The process's cache, when [`enable`]d.
pub fn get() -> Option<&'static Cache> {
    CACHE.get()
}

/// NVRTC's version (major·1000 + minor·10) and library path, loading `library` (empty:
/// the one already loaded, else the loader's search), or why it is unavailable.
pub fn nvrtc(library: &str) -> Result<(i32, String), String> {
    let v = ffi::nvrtc_version(library).map_err(|e| e.what().to_string())?;
    let p = ffi::nvrtc_library_path(library).map_err(|e| e.what().to_string())?;
    Ok((v, p))
}

/// Compile with NVRTC directly (no cache): for checks of the compile path.
pub fn nvrtc_compile(
    library: &str,
    source: &str,
    file: &str,
    name_expr: &str,
    options: &[String],
    cubin: bool,
) -> Result<(Vec<u8>, String), String> {
    let out = ffi::nvrtc_compile(
        library,
        source,
        file,
        &[name_expr.to_string()],
        options,
        cubin,
    )
    .map_err(|e| e.what().to_string())?;
    Ok((
        out.binary,
        out.lowered.into_iter().next().unwrap_or_default(),
    ))
}

/// One kernel for NVRTC: what [`nvrtc_compile`] takes, and what a compile process reads
/// on its standard input (JSON).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct CompileJob {
    pub library: String,
    pub source: String,
    pub file: String,
    pub name_expr: String,
    pub options: Vec<String>,
    pub cubin: bool,
}

impl CompileJob {
    /// Compile in this process: (binary, lowered name).
    pub fn run(&self) -> Result<(Vec<u8>, String), String> {
        nvrtc_compile(
            &self.library,
            &self.source,
            &self.file,
            &self.name_expr,
            &self.options,
            self.cubin,
        )
    }
}

/// Why a compile process gave no binary.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// It could not be started.
    #[error("starting it: {0}")]
    Start(std::io::Error),
    /// It failed or answered nonsense.
    #[error("{0}")]
    Broken(String),
    /// It ran past its time and was stopped.
    #[error("the compile process ran past {0:.1} s and was stopped")]
    Timeout(f64),
    /// NVRTC failed: its log.
    #[error("{0}")]
    Compile(String),
}

/// A compile process failed before any worked: later kernels compile in this process.
static WORKERS_BROKEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// A compile process has worked in this process.
static WORKERS_OK: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The first line a compile process writes: its result, the binary's bytes after it.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct WorkerAnswer {
    lowered: String,
    len: usize,
    error: Option<String>,
}

/// How long a compile process may take before it is stopped (a variant compiles in a few
/// seconds).
pub const COMPILE_TIMEOUT: Duration = Duration::from_secs(300);

/// Compile `job` in a process of its own, started as `worker` (program, then arguments),
/// which runs [`serve_worker`]; one that runs past `timeout` is stopped.
pub fn compile_in_worker(
    worker: &[OsString],
    job: &CompileJob,
    timeout: Duration,
) -> Result<(Vec<u8>, String), WorkerError> {
    let (program, args) = worker
        .split_first()
        .ok_or_else(|| WorkerError::Broken("no compile command".into()))?;
    let request = serde_json::to_vec(job).map_err(|e| WorkerError::Broken(e.to_string()))?;
    let mut child = std::process::Command::new(program)
        .args(args)
        // (NVRTC needs no GPU: the process gets none, so nothing in it can claim one)
        .env("CUDA_VISIBLE_DEVICES", "")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(WorkerError::Start)?;
    let deadline = Instant::now() + timeout;
    // the job written and the answer read on threads of their own, so that only the wait
    // below can block, and it has a deadline (a process that died at once shows in its exit
    // status)
    let mut stdin = child.stdin.take().expect("piped");
    let mut stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let thread = || std::thread::Builder::new().name("kernel-compile-io".into());
    let io = thread()
        .spawn(move || {
            let _ = stdin.write_all(&request);
            drop(stdin);
            let mut b = Vec::new();
            let _ = stdout.read_to_end(&mut b);
            b
        })
        .and_then(|out| {
            let err = thread().spawn(move || {
                let mut b = Vec::new();
                let _ = stderr.read_to_end(&mut b);
                b
            })?;
            Ok((out, err))
        });
    let stop = |child: &mut std::process::Child| {
        let _ = child.kill();
        let _ = child.wait();
    };
    let (stdout, stderr) = match io {
        Ok(threads) => threads,
        Err(e) => {
            stop(&mut child);
            return Err(WorkerError::Broken(format!(
                "no thread for its output: {e}"
            )));
        }
    };
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(None) => {
                stop(&mut child);
                return Err(WorkerError::Timeout(timeout.as_secs_f64()));
            }
            Err(e) => {
                stop(&mut child);
                return Err(WorkerError::Broken(format!(
                    "waiting for the compile process: {e}"
                )));
            }
        }
    };
    let stdout = stdout.join().unwrap_or_default();
    let stderr = stderr.join().unwrap_or_default();
    let failed = |what: &str| {
        WorkerError::Broken(format!(
            "the compile process {what} ({status}): {}",
            String::from_utf8_lossy(&stderr).trim()
        ))
    };
    let Some(nl) = stdout.iter().position(|&b| b == b'\n') else {
        return Err(failed("gave no answer"));
    };
    let answer: WorkerAnswer =
        serde_json::from_slice(&stdout[..nl]).map_err(|_| failed("answered nonsense"))?;
    if let Some(e) = answer.error {
        return Err(WorkerError::Compile(e));
    }
    let binary = &stdout[nl + 1..];
    if binary.len() != answer.len {
        return Err(failed("cut its answer short"));
    }
    Ok((binary.to_vec(), answer.lowered))
}

/// A compile process's side of [`compile_in_worker`]: read a [`CompileJob`] (JSON) from
/// standard input, compile it, and write the answer line and the binary to standard
/// output. Touches nothing of MLX but NVRTC.
pub fn serve_worker() -> Result<(), String> {
    let mut request = Vec::new();
    std::io::stdin()
        .read_to_end(&mut request)
        .map_err(|e| format!("reading the job: {e}"))?;
    let job: CompileJob =
        serde_json::from_slice(&request).map_err(|e| format!("reading the job: {e}"))?;
    let (answer, binary) = match job.run() {
        Ok((binary, lowered)) => (
            WorkerAnswer {
                lowered,
                len: binary.len(),
                error: None,
            },
            binary,
        ),
        Err(e) => (
            WorkerAnswer {
                lowered: String::new(),
                len: 0,
                error: Some(e),
            },
            Vec::new(),
        ),
    };
    let mut out = std::io::stdout().lock();
    let line = serde_json::to_string(&answer).map_err(|e| e.to_string())?;
    writeln!(out, "{line}")
        .and_then(|()| out.write_all(&binary))
        .and_then(|()| out.flush())
        .map_err(|e| format!("writing the answer: {e}"))
}

/// A custom-kernel launch (called by [`super::fast::CudaKernel::call`] with its launch
/// key and first output): on the first sight of the key in this process, make sure its
/// module has a cache entry.
pub(crate) fn note_variant(key: u64, out: &Array) {
    let Some(cache) = get() else { return };
    let compiling = if cache.first_sight(key) {
        match ffi::kernel_identity(out.raw()) {
            Ok(id) => cache.ensure(key, &id),
            Err(e) => {
                tracing::debug!("kernel cache: {}", e.what());
                false
            }
        }
    } else {
        cache.is_pending(key)
    };
    if compiling {
        NEEDED.with(|n| n.borrow_mut().push(key));
    }
}

thread_local! {
    /// The variants this thread launched since its last evaluation whose compilation
    /// was pending then: what its next evaluation waits for.
    static NEEDED: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// Before an evaluation: wait for the compilations still pending among the variants
/// this thread launched since its last evaluation (nothing when there are none).
pub(crate) fn wait_pending() {
    let keys = NEEDED.with(|n| std::mem::take(&mut *n.borrow_mut()));
    if let (false, Some(c)) = (keys.is_empty(), get()) {
        c.wait_for(&keys);
    }
}

/// The variants this thread launched since its last evaluation that are still compiling
/// (what that evaluation would wait for), taken: the list is empty after, so their
/// compilations go on in the background, and a later launch of one still compiling
/// waits for it then.
pub fn take_needed() -> Vec<u64> {
    NEEDED.with(|n| std::mem::take(&mut *n.borrow_mut()))
}

/// What this thread's next evaluation waits for, instead of what it launched since the
/// last one: `keys` from [`take_needed`] (those done by then are not waited for).
pub fn set_needed(keys: Vec<u64>) {
    NEEDED.with(|n| *n.borrow_mut() = keys);
}

/// Compilations under way in this process.
pub fn pending() -> usize {
    get().map_or(0, |c| c.pending_fast.load(Ordering::SeqCst))
}

/// The launch key of a custom-kernel call: its name and everything that changes the
/// source MLX generates for it.
pub(crate) fn launch_key(
    name: &str,
    input_dtypes: impl Iterator<Item = super::Dtype>,
    outputs: usize,
    out_dtype: super::Dtype,
    template_values: &[i32],
    tdtype: super::Dtype,
) -> u64 {
    // hashed piece by piece (no allocation: it runs at every kernel call)
    let mut h = fnv1a_from(FNV_OFFSET, name.as_bytes());
    h = fnv1a_from(h, &[0]);
    for d in input_dtypes {
        h = fnv1a_from(h, &[d.repr]);
    }
    h = fnv1a_from(h, &[0xFF]);
    h = fnv1a_from(h, &(outputs as u32).to_le_bytes());
    h = fnv1a_from(h, &[out_dtype.repr, tdtype.repr]);
    for v in template_values {
        h = fnv1a_from(h, &v.to_le_bytes());
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    fn id(module: &str) -> ffi::KernelIdentity {
        ffi::KernelIdentity {
            kernel_name: format!("custom_kernel_{module}"),
            module_name: module.to_string(),
            source: format!(
                "\n{MLX_UTILS_INCLUDE}\n\n#include <cooperative_groups.h>\n\nbody of {module}\n"
            ),
        }
    }

    fn key(module: &str) -> u64 {
        fnv1a(module.as_bytes())
    }

    fn counting(calls: Arc<AtomicUsize>) -> Arc<Compiler> {
        Arc::new(move |src: &str, file: &str, name: &str| {
            calls.fetch_add(1, Ordering::SeqCst);
            assert!(src.contains("#include <cuda_bf16.h>") && !src.contains(MLX_UTILS_INCLUDE));
            assert!(file.ends_with(".cu") && name.starts_with("mlx::core::cu::custom_kernel_"));
            Ok((
                format!("binary of {name}").into_bytes(),
                format!("_Z{}", name.len()),
            ))
        })
    }

    #[test]
    fn entries_are_built_once_reused_and_rebuilt_when_bad() {
        let dir = tempfile::tempdir().unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let c = Cache::new(dir.path().to_path_buf(), 2, counting(calls.clone()));
        assert!(c.ensure(key("k1"), &id("k1")));
        assert!(c.ensure(key("k2"), &id("k2")));
        c.wait();
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        // the files MLX reads: the binary and `name\tlowered`
        let txt = std::fs::read_to_string(dir.path().join("k1.txt")).unwrap();
        assert_eq!(txt, "mlx::core::cu::custom_kernel_k1\t_Z31\n");
        assert_eq!(
            std::fs::read(dir.path().join("k1.ptx")).unwrap(),
            b"binary of mlx::core::cu::custom_kernel_k1"
        );
        // a second process (a fresh cache on the folder) finds both: no compilation
        let c2 = Cache::new(dir.path().to_path_buf(), 2, counting(calls.clone()));
        assert!(!c2.ensure(key("k1"), &id("k1")) && !c2.ensure(key("k2"), &id("k2")));
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        assert_eq!(c2.stats().hits, 2);
        // a corrupted binary, a missing check file: both rebuilt
        std::fs::write(dir.path().join("k1.ptx"), b"binary of something else").unwrap();
        std::fs::remove_file(dir.path().join("k2.sum")).unwrap();
        let c3 = Cache::new(dir.path().to_path_buf(), 1, counting(calls.clone()));
        assert!(c3.ensure(key("k1"), &id("k1")) && c3.ensure(key("k2"), &id("k2")));
        c3.wait();
        assert_eq!(calls.load(Ordering::SeqCst), 4);
        assert_eq!(c3.stats().invalid, 2);
        assert_eq!(c3.stats().built, 2);
        let c4 = Cache::new(dir.path().to_path_buf(), 1, counting(calls.clone()));
        assert!(!c4.ensure(key("k1"), &id("k1")) && !c4.ensure(key("k2"), &id("k2")));
        // no temporary files are left behind
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
        assert_eq!(names.len(), 6, "{names:?}");
    }

    /// Waiting for some variants returns once they are written, while another is still
    /// compiling; that one's entry appears when its compilation ends.
    #[test]
    fn a_wait_for_some_variants_leaves_the_others_compiling() {
        let dir = tempfile::tempdir().unwrap();
        // "slow" compiles only once released
        let (release, gate) = std::sync::mpsc::channel::<()>();
        let gate = Mutex::new(gate);
        let compiler: Arc<Compiler> = Arc::new(move |_: &str, file: &str, name: &str| {
            if file.starts_with("slow") {
                gate.lock().unwrap().recv().map_err(|e| e.to_string())?;
            }
            Ok((format!("binary of {name}").into_bytes(), "_Z1".into()))
        });
        let c = Cache::new(dir.path().to_path_buf(), 4, compiler);
        assert!(c.ensure(key("slow"), &id("slow")));
        assert!(c.ensure(key("fast"), &id("fast")));
        // a second `ensure` of a variant still compiling starts nothing more
        assert!(c.ensure(key("slow"), &id("slow")));
        c.wait_for(&[key("fast")]);
        assert!(dir.path().join("fast.ptx").exists());
        assert!(!c.is_pending(key("fast")));
        assert!(c.is_pending(key("slow")));
        assert!(!dir.path().join("slow.ptx").exists());
        assert_eq!(c.stats().built, 1);
        release.send(()).unwrap();
        c.wait_for(&[key("slow"), key("fast")]);
        assert!(!c.is_pending(key("slow")));
        assert!(dir.path().join("slow.ptx").exists());
        assert_eq!(c.stats().built, 2);
        c.wait();
    }

    /// A compile process's answer as [`serve_worker`] writes it is read back; a process
    /// that cannot start, dies, or cuts its answer short is told apart from a compile
    /// error (which comes back as NVRTC's log).
    #[test]
    fn compile_processes_answer_or_fail_plainly() {
        let job = CompileJob {
            library: String::new(),
            source: "k".into(),
            file: "k.cu".into(),
            name_expr: "k".into(),
            options: vec![],
            cubin: true,
        };
        const T: Duration = Duration::from_secs(60);
        let sh = |script: &str| -> Vec<OsString> {
            vec![
                "sh".into(),
                "-c".into(),
                format!("cat >/dev/null; {script}").into(),
            ]
        };
        let ok = sh(r#"printf '{"lowered":"_Z1k","len":3,"error":null}\nabc'"#);
        let (bin, lowered) = compile_in_worker(&ok, &job, T).unwrap();
        assert_eq!((bin.as_slice(), lowered.as_str()), (&b"abc"[..], "_Z1k"));
        let log = sh(r#"printf '{"lowered":"","len":0,"error":"k.cu(1): error"}\n'"#);
        assert!(
            matches!(compile_in_worker(&log, &job, T), Err(WorkerError::Compile(e)) if e == "k.cu(1): error")
        );
        let short = sh(r#"printf '{"lowered":"_Z1k","len":9,"error":null}\nabc'"#);
        assert!(matches!(
            compile_in_worker(&short, &job, T),
            Err(WorkerError::Broken(_))
        ));
        let died = sh("echo oops >&2; exit 3");
        match compile_in_worker(&died, &job, T) {
            Err(WorkerError::Broken(e)) => assert!(e.contains("oops"), "{e}"),
            other => panic!("{other:?}"),
        }
        let missing = vec![OsString::from("/nonexistent/mlxcel")];
        assert!(matches!(
            compile_in_worker(&missing, &job, T),
            Err(WorkerError::Start(_))
        ));
        // one that hangs is stopped at the timeout
        let t = Instant::now();
        match compile_in_worker(&sh("sleep 30"), &job, Duration::from_millis(300)) {
            Err(e @ WorkerError::Timeout(_)) => assert!(e.to_string().contains("ran past"), "{e}"),
            other => panic!("{other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    }

    /// A compiler that panics ends its job all the same: the variant is no longer pending
    /// and its compile slot is free for the next one.
    #[test]
    fn a_panicking_compilation_still_ends_its_job() {
        let dir = tempfile::tempdir().unwrap();
        let compiler: Arc<Compiler> = Arc::new(|_: &str, file: &str, name: &str| {
            if file.starts_with("boom") {
                panic!("the compiler crashed");
            }
            Ok((format!("binary of {name}").into_bytes(), "_Z1".into()))
        });
        let c = Arc::new(Cache::new(dir.path().to_path_buf(), 1, compiler));
        assert!(c.ensure(key("boom"), &id("boom")));
        assert!(c.ensure(key("next"), &id("next")));
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = c.clone();
        std::thread::spawn(move || {
            waiter.wait_for(&[key("boom"), key("next")]);
            tx.send(()).unwrap();
        });
        rx.recv_timeout(std::time::Duration::from_secs(20))
            .expect("the wait ended");
        assert!(!c.is_pending(key("boom")));
        assert!(dir.path().join("next.ptx").exists());
    }

    #[test]
    fn failed_compilations_leave_no_entry() {
        let dir = tempfile::tempdir().unwrap();
        let failing: Arc<Compiler> = Arc::new(|_: &str, _: &str, _: &str| Err("no".into()));
        let c = Cache::new(dir.path().to_path_buf(), 1, failing);
        assert!(c.ensure(key("k"), &id("k")));
        c.wait();
        assert_eq!(c.stats().failed, 1);
        assert!(!dir.path().join("k.ptx").exists());
        // a source without MLX's header line is left to MLX, not compiled
        let mut other = id("j");
        other.source = "no header here".into();
        assert!(!c.ensure(key("j"), &other));
        assert_eq!(c.stats().failed, 2);
    }

    #[test]
    fn long_module_names_are_cut_into_folders_as_mlx_does() {
        let long = "m".repeat(600);
        let p = EntryPaths::new(Path::new("/c"), &long);
        let expect = format!(
            "/c/{}/{}/{}.ptx",
            "m".repeat(245),
            "m".repeat(245),
            "m".repeat(110)
        );
        assert_eq!(p.ptx, PathBuf::from(expect));
        assert_eq!(
            EntryPaths::new(Path::new("/c"), "short").txt,
            PathBuf::from("/c/short.txt")
        );
    }

    #[test]
    fn launch_keys_differ_by_what_changes_the_source() {
        use crate::mlx::Dtype;
        let k = |n: &str, t: &[i32], d: Dtype| {
            launch_key(n, [Dtype::BF16, Dtype::U32].into_iter(), 1, d, t, d)
        };
        let a = k("q", &[1, 2], Dtype::BF16);
        assert_eq!(a, k("q", &[1, 2], Dtype::BF16));
        assert_ne!(a, k("q", &[1, 3], Dtype::BF16));
        assert_ne!(a, k("q", &[1, 2], Dtype::F16));
        assert_ne!(a, k("r", &[1, 2], Dtype::BF16));
    }
}
