//! The CUDA kernels (src/backend/cuda/kernels/, joined as for NVRTC) on CPU threads, against plain
//! double-precision references (the kernels/*_reference.cpp beside them; the harness in
//! tests/cuda_emu/checks.cpp): the decode GEMVs (several matrices per launch, rows per block 1 to
//! 8, the input normalised in the block or by rms_inv, adding into the output, the MLP's gate and
//! up with the SwiGLU, and the streaming one of rows of 1024), the f32 GEMM, the norms, SwiGLU and
//! the conv of a prefill (with the q/k l2 norm), the decode attention (split over the positions)
//! and the tiled one, the decode DeltaNet step (two launches: the conv window, the state and the
//! blocks' hand-over carry from one to the next), the chunked delta rule of a prefill and the
//! greedy pick (argmax_rows), the draw with its top-k and top-p cuts (sample_rows) and a grammar's mask (mask_rows); the prefill kernels of a packed prefill against each sequence alone; and the tensor-core attention and state walk against the f32 kernels
//! (the tensor-core instructions emulated: shim.h); and every kernel's Rust declaration (the
//! parameter types a launch passes) against its C++ signature. A kernel's logic is checked on every
//! machine with a C++ compiler, GPU or not (tests/cuda.rs holds the real GPU to the CPU engine
//! where there is one). Ignored where no C++ compiler was found when the tests were built
//! (build.rs).

mod common;

use std::process::Command;

#[test]
#[cfg_attr(not(tandem_cxx), ignore = "no C++ compiler (c++, g++, clang++ or $CXX) was found when the tests were built")]
fn cuda_kernels_on_cpu_threads_match_their_references() {
    let here = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let candidates = std::env::var("CXX").into_iter().chain(["c++", "g++", "clang++"].map(String::from));
    let works = |c: &String| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success());
    let Some(cxx) = candidates.into_iter().find(works) else {
        panic!("the CUDA kernels on CPU threads need a C++ compiler: none of $CXX, c++, g++, clang++ runs here");
    };
    let dir = common::scratch("cuda_emu");
    // The one source NVRTC compiles on a GPU: the kernel files joined.
    let kernels = tandem_core::backend::cuda::kernels::source();
    // Dynamic shared memory only through common.cuh's DYNAMIC_SHARED, which gives a block static
    // storage here.
    let dynamic = kernels.matches("extern __shared__").count();
    assert!(dynamic == kernels.matches("#define DYNAMIC_SHARED(T, name, most) extern __shared__").count(), "the kernels declare dynamic shared memory outside DYNAMIC_SHARED, which shim.h does not map");
    // The tensor-core instruction (inline PTX) becomes its emulation.
    let (mma, end) = ("#if __CUDA_ARCH__ >= 800\n    asm volatile(\"mma.sync", "#endif");
    let at = kernels.find(mma).expect("common.cuh: the mma instruction is not where this test looks for it");
    let to = at + kernels[at..].find(end).unwrap() + end.len();
    let kernels = format!("{}    mma_emulated(d, a, b0, b1);\n{}", &kernels[..at], &kernels[to..]);
    // And so does the shared-memory matrix load that feeds it.
    let ldmatrix = "#if __CUDA_ARCH__ >= 800\n    unsigned s = (unsigned)__cvta_generic_to_shared(p);\n    if (TRANS) asm volatile(\"ldmatrix";
    let at = kernels.find(ldmatrix).expect("common.cuh: the ldmatrix instruction is not where this test looks for it");
    let to = at + kernels[at..].find(end).unwrap() + end.len();
    let kernels = format!("{}    ldmatrix_emulated<TRANS>(r, p);\n{}", &kernels[..at], &kernels[to..]);
    // Every kernel's Rust declaration (backend/cuda/kernels/mod.rs) against its C++ parameter
    // list: a launch passes exactly the declared types, so a mismatch here is a wrong launch.
    let mut signatures = String::from(
        "#include <tuple>\n#include <type_traits>\n\
         template <class T> struct rust_param { using type = T; };\n\
         template <class T> struct rust_param<const T*> { using type = T*; };\n\
         template <class... A> std::tuple<typename rust_param<A>::type...> rust_params(void (*)(A...));\n",
    );
    for (name, params) in tandem_core::backend::cuda::kernels::ALL {
        let want = params.join(", ");
        signatures += &format!("static_assert(std::is_same<decltype(rust_params(&{name})), std::tuple<{want}>>::value, \"{name}: the Rust declaration ({want}) differs from the kernel's parameters\");\n");
    }
    std::fs::write(dir.join("kernels_emu.cu"), format!("#include \"shim.h\"\n{kernels}\n{signatures}")).unwrap();
    for f in ["shim.h", "checks.cpp"] {
        std::fs::copy(here.join("tests/cuda_emu").join(f), dir.join(f)).unwrap();
    }
    // Each family's references and checks, beside its kernels.
    for (file, _) in tandem_core::backend::cuda::kernels::SOURCES {
        let Some(family) = file.strip_suffix(".cu") else { continue };
        let reference = format!("{family}_reference.cpp");
        std::fs::copy(here.join("src/backend/cuda/kernels").join(&reference), dir.join(&reference)).unwrap_or_else(|e| panic!("kernels/{family}.cu has no {reference} beside it: {e}"));
    }
    let built = Command::new(&cxx).current_dir(&dir).args(["-std=c++17", "-O2", "-pthread", "-w", "checks.cpp", "-o", "checks"]).output().unwrap();
    assert!(built.status.success(), "{cxx} could not build the kernels for the CPU:\n{}", String::from_utf8_lossy(&built.stderr));
    let ran = Command::new(dir.join("checks")).output().unwrap();
    let report = String::from_utf8_lossy(&ran.stdout);
    eprintln!("{report}");
    assert!(ran.status.success(), "kernels out of bounds against their references (lines marked FAIL):\n{report}{}", String::from_utf8_lossy(&ran.stderr));
    assert!(report.lines().filter(|l| l.starts_with("ok")).count() >= 64, "fewer checks ran than written:\n{report}");
    let _ = std::fs::remove_dir_all(&dir);
}
