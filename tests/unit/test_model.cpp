#include <catch2/catch.hpp>

#include <cstdint>
#include <limits>
#include <vector>

#include "config/config.hpp"
#include "refit/error.hpp"
#include "refit/model.hpp"
#include "refit/version.hpp"

using refit::dtype;

TEST_CASE("itemsize knows every dtype", "[model]") {
  CHECK(refit::itemsize(dtype::bool_) == 1);
  CHECK(refit::itemsize(dtype::u8) == 1);
  CHECK(refit::itemsize(dtype::i8) == 1);
  CHECK(refit::itemsize(dtype::i16) == 2);
  CHECK(refit::itemsize(dtype::i32) == 4);
  CHECK(refit::itemsize(dtype::i64) == 8);
  CHECK(refit::itemsize(dtype::f16) == 2);
  CHECK(refit::itemsize(dtype::bf16) == 2);
  CHECK(refit::itemsize(dtype::f32) == 4);
  CHECK(refit::itemsize(dtype::f64) == 8);
  CHECK(refit::itemsize(dtype::f8_e4m3) == 1);
  CHECK(refit::itemsize(dtype::f8_e5m2) == 1);
  CHECK(refit::itemsize(dtype::u16) == 2);
  CHECK(refit::itemsize(dtype::u32) == 4);
  CHECK(refit::itemsize(dtype::u64) == 8);
}

TEST_CASE("every dtype round-trips through its canonical name and its wire code", "[model]") {
  for (std::uint64_t code = 0; code <= 14; ++code) {
    const auto t = refit::dtype_from_code(code);
    REQUIRE(t);
    CHECK(static_cast<std::uint64_t>(*t) == code);
    CHECK(refit::parse_dtype(refit::to_string(*t)) == t);
  }
  CHECK_FALSE(refit::dtype_from_code(15));
  CHECK_FALSE(refit::dtype_from_code(std::numeric_limits<std::uint64_t>::max()));
}

TEST_CASE("parse_dtype accepts canonical, safetensors and torch names", "[model]") {
  CHECK(refit::parse_dtype("bf16") == dtype::bf16);
  CHECK(refit::parse_dtype("f8_e4m3") == dtype::f8_e4m3);
  CHECK(refit::parse_dtype("BF16") == dtype::bf16);
  CHECK(refit::parse_dtype("F8_E4M3") == dtype::f8_e4m3);
  CHECK(refit::parse_dtype("BOOL") == dtype::bool_);
  CHECK(refit::parse_dtype("F32") == dtype::f32);
  CHECK(refit::parse_dtype("I64") == dtype::i64);
  CHECK(refit::parse_dtype("bfloat16") == dtype::bf16);
  CHECK(refit::parse_dtype("float16") == dtype::f16);
  CHECK(refit::parse_dtype("float32") == dtype::f32);
  CHECK(refit::parse_dtype("int64") == dtype::i64);
  CHECK(refit::parse_dtype("uint8") == dtype::u8);
  CHECK(refit::parse_dtype("float8_e4m3fn") == dtype::f8_e4m3);
  CHECK(refit::parse_dtype("float8_e5m2") == dtype::f8_e5m2);
  CHECK(refit::parse_dtype("torch.bfloat16") == dtype::bf16);
}

TEST_CASE("parse_dtype returns nullopt for unknown names", "[model]") {
  CHECK_FALSE(refit::parse_dtype(""));
  CHECK_FALSE(refit::parse_dtype("f128"));
  CHECK_FALSE(refit::parse_dtype("complex64"));
  CHECK_FALSE(refit::parse_dtype("bf16 "));
}

TEST_CASE("checked_nbytes multiplies the shape by the itemsize and refuses overflow", "[model]") {
  const std::vector<std::int64_t> shape{3, 5, 7};
  CHECK(refit::checked_nbytes(dtype::f32, shape) == 3u * 5 * 7 * 4);
  CHECK(refit::checked_numel(shape) == 105u);
  CHECK(refit::checked_nbytes(dtype::bf16, std::vector<std::int64_t>{}) == 2u);  // a scalar
  CHECK(refit::checked_nbytes(dtype::f64, std::vector<std::int64_t>{4, 0, 9}) == 0u);

  const std::int64_t big = std::numeric_limits<std::int64_t>::max();
  CHECK_FALSE(refit::checked_numel(std::vector<std::int64_t>{big, 3}));
  CHECK_FALSE(refit::checked_nbytes(dtype::f32, std::vector<std::int64_t>{std::int64_t{1} << 62}));
  CHECK_FALSE(refit::checked_nbytes(dtype::u8, std::vector<std::int64_t>{1 << 30, 1 << 30, 1 << 30}));
  CHECK_FALSE(refit::checked_numel(std::vector<std::int64_t>{4, -1}));
  CHECK_FALSE(refit::checked_nbytes(dtype::u8, std::vector<std::int64_t>{-2}));
}

TEST_CASE("tensor_meta::nbytes throws invalid_argument on a bad shape", "[model]") {
  refit::tensor_meta ok{"w", dtype::bf16, {4096, 1024}};
  CHECK(ok.nbytes() == 4096u * 1024 * 2);
  CHECK(ok.numel() == 4096u * 1024);

  refit::tensor_meta negative{"neg", dtype::f32, {3, -1}};
  refit::tensor_meta huge{"huge", dtype::f64, {std::numeric_limits<std::int64_t>::max(), 2}};
  for (const auto* m : {&negative, &huge}) {
    try {
      (void)m->nbytes();
      FAIL("nbytes() did not throw for " << refit::describe(*m));
    } catch (const refit::error& e) {
      CHECK(e.code() == refit::errc::invalid_argument);
      CHECK_THAT(e.what(), Catch::Contains(m->name));
    }
  }
  CHECK_THROWS_AS(negative.numel(), refit::error);
}

TEST_CASE("describe names the tensor, its dtype and its shape", "[model]") {
  CHECK(refit::describe({"layers.0.w", dtype::bf16, {4096, 4096}}) == "layers.0.w bf16[4096, 4096]");
}

TEST_CASE("version and has_transport report what the library was built with", "[model]") {
  CHECK(refit::version() == REFIT_VERSION);
  CHECK(refit::has_cuda() == (REFIT_HAVE_CUDA != 0));
  CHECK(refit::has_transport(refit::transport_kind::host_shm));
  CHECK(refit::has_transport(refit::transport_kind::cuda_ipc) == (REFIT_HAVE_CUDA != 0));
  CHECK(refit::has_transport(refit::transport_kind::nccl) == (REFIT_HAVE_NCCL != 0));
}
