# Imported targets for the torch that the active Python imports, without find_package(Torch):
# its config demands a CUDA toolkit matching torch's, which a CPU-only build need not have.
#   torch_from_python       c10 + torch_cpu + torch (headers, libraries, ABI flag)
#   torch_cuda_from_python  c10_cuda + torch_cuda
# Sets TORCH_VERSION, TORCH_CUDA_VERSION ("" for a CPU build), TORCH_LIBRARY_DIR, TORCH_CXX_STANDARD.
execute_process(
  COMMAND ${Python_EXECUTABLE} -c "import os, torch
print(torch.__version__)
print(torch.version.cuda or '')
print(os.path.dirname(torch.__file__))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
  OUTPUT_VARIABLE torch_facts OUTPUT_STRIP_TRAILING_WHITESPACE
  RESULT_VARIABLE torch_found)
if(NOT torch_found EQUAL 0)
  message(FATAL_ERROR "mirage: '${Python_EXECUTABLE}' cannot import torch; install torch first")
endif()
string(REPLACE "\n" ";" torch_facts "${torch_facts}")
list(GET torch_facts 0 TORCH_VERSION)
list(GET torch_facts 1 TORCH_CUDA_VERSION)
list(GET torch_facts 2 torch_root)
list(GET torch_facts 3 torch_cxx11_abi)
set(TORCH_LIBRARY_DIR ${torch_root}/lib)

# Build with the C++ standard torch was built with (17 up to torch 2.12, 20 from 2.13): the
# exception and string types that cross into torch must have the layout torch expects.
set(TORCH_CXX_STANDARD 17)
file(STRINGS ${torch_root}/share/cmake/Torch/TorchConfig.cmake torch_std_line REGEX "CXX_STANDARD [0-9]+")
if(torch_std_line MATCHES "CXX_STANDARD ([0-9]+)")
  set(TORCH_CXX_STANDARD ${CMAKE_MATCH_1})
endif()
message(STATUS "mirage: torch ${TORCH_VERSION} (CUDA '${TORCH_CUDA_VERSION}', C++${TORCH_CXX_STANDARD}) at ${torch_root}")

add_library(torch_from_python INTERFACE)
target_include_directories(torch_from_python SYSTEM INTERFACE
  ${torch_root}/include ${torch_root}/include/torch/csrc/api/include)
target_compile_definitions(torch_from_python INTERFACE _GLIBCXX_USE_CXX11_ABI=${torch_cxx11_abi})
target_link_libraries(torch_from_python INTERFACE
  ${TORCH_LIBRARY_DIR}/libc10.so ${TORCH_LIBRARY_DIR}/libtorch_cpu.so ${TORCH_LIBRARY_DIR}/libtorch.so)

if(TORCH_CUDA_VERSION)
  add_library(torch_cuda_from_python INTERFACE)
  target_compile_definitions(torch_cuda_from_python INTERFACE USE_CUDA)
  target_link_libraries(torch_cuda_from_python INTERFACE
    ${TORCH_LIBRARY_DIR}/libc10_cuda.so ${TORCH_LIBRARY_DIR}/libtorch_cuda.so CUDA::cudart)
endif()
