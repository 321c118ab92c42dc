// One include for Catch2 v2 (Debian) and v3 (the GPU machines).
#pragma once

#if defined(MIRAGE_CATCH2_V3)
#include <catch2/catch_test_macros.hpp>
#define MIRAGE_SKIP(msg) SKIP(msg)
#else
#include <catch2/catch.hpp>
// v2 has no SKIP: say why and leave the test case.
#define MIRAGE_SKIP(msg) \
  do {                   \
    WARN(msg);           \
    return;              \
  } while (0)
#endif
