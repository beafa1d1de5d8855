// qmatmul's handlers for the 256-value K-quant formats: Q4_K, Q5_K, Q6_K.
#include "qmatmul.h"

namespace {
// Each format's parts (Spec, qmatmul.h): dtypes and values per entry, in FORMATS order.
SPEC(Q4_K, LIST(DataType::U8, DataType::U8, DataType::U8, DataType::F16, DataType::F16),
     LIST(2, 32, 32, 256, 256), P(0, uint8_t), P(1, uint8_t), P(2, uint8_t), P(3, uint16_t),
     P(4, uint16_t))
SPEC(Q5_K,
     LIST(DataType::U8, DataType::U8, DataType::U8, DataType::U8, DataType::F16, DataType::F16),
     LIST(2, 8, 32, 32, 256, 256), P(0, uint8_t), P(1, uint8_t), P(2, uint8_t), P(3, uint8_t),
     P(4, uint16_t), P(5, uint16_t))
SPEC(Q6_K, LIST(DataType::U8, DataType::U8, DataType::S8, DataType::F16), LIST(2, 4, 16, 256),
     P(0, uint8_t), P(1, uint8_t), P(2, int8_t), P(3, uint16_t))
}  // namespace

QMATMUL_HANDLER(q4_k, Q4_K)
QMATMUL_HANDLER(q5_k, Q5_K)
QMATMUL_HANDLER(q6_k, Q6_K)
