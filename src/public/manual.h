/* dtrain.h - v0.1.0 - distributed deep-learning training in C. MIT license (end of file).

   Drop-in use: in ONE C or C++ file

       #define DTRAIN_IMPLEMENTATION
       #include "dtrain.h"

   and include "dtrain.h" normally everywhere else. Link with -lm -lpthread. Nothing else is
   required; optional switches (define before the implementation include):

       DTR_USE_ZLIB    read gzip-compressed IDX files through zlib (link -lz)
       DTR_USE_CBLAS   route GEMM through a system BLAS's cblas_sgemm (link e.g. -lopenblas)
       DTR_USE_STB_IMAGE  decode PNG/JPEG/BMP images with stb_image (header only; Debian's
                       libstb-dev, or set DTR_STB_IMAGE_HEADER to your copy's path)
       DTR_NO_SIMD     portable C only: no AVX2 / AVX-512 code compiled with target
                       attributes (GEMM kernels, element loops). At run time the environment
                       variables DTRAIN_GEMM_KERNEL=avx512|avx2|generic and
                       DTRAIN_SIMD=avx2|generic choose among them.

   See README.md and docs/ for the guides; every public function below has a doc comment.
*/
