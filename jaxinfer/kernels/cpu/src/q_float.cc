// qmatmul's handlers for the per-row and float formats: int8, f16, bf16, f32.
#include "qmatmul.h"

namespace {
// Each format's parts (Spec, qmatmul.h): dtypes and values per entry, in FORMATS order.
SPEC(Int8, LIST(DataType::S8, DataType::F32), LIST(1, 0), P(0, int8_t), P(1, float))
SPEC(Half<false>, DataType::F16, 1, P(0, uint16_t))
SPEC(Half<true>, DataType::BF16, 1, P(0, uint16_t))
SPEC(Full, DataType::F32, 1, P(0, float))
}  // namespace

QMATMUL_HANDLER(int8, Int8)
QMATMUL_HANDLER(f16, Half<false>)
QMATMUL_HANDLER(bf16, Half<true>)
QMATMUL_HANDLER(f32, Full)
