// qmatmul's handlers for the 32-value block formats: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1.
#include "qmatmul.h"

namespace {
// Each format's parts (Spec, qmatmul.h): dtypes and values per entry, in FORMATS order.
SPEC(Q8_0, LIST(DataType::S8, DataType::F16), LIST(1, 32), P(0, int8_t), P(1, uint16_t))
SPEC(Q4<false>, LIST(DataType::U8, DataType::F16), LIST(2, 32), P(0, uint8_t), P(1, uint16_t),
     nullptr)
SPEC(Q4<true>, LIST(DataType::U8, DataType::F16, DataType::F16), LIST(2, 32, 32),
     P(0, uint8_t), P(1, uint16_t), P(2, uint16_t))
SPEC(Q5<false>, LIST(DataType::U8, DataType::U8, DataType::F16), LIST(2, 8, 32),
     P(0, uint8_t), P(1, uint8_t), P(2, uint16_t), nullptr)
SPEC(Q5<true>, LIST(DataType::U8, DataType::U8, DataType::F16, DataType::F16),
     LIST(2, 8, 32, 32), P(0, uint8_t), P(1, uint8_t), P(2, uint16_t), P(3, uint16_t))
}  // namespace

QMATMUL_HANDLER(q8_0, Q8_0)
QMATMUL_HANDLER(q4_0, Q4<false>)
QMATMUL_HANDLER(q4_1, Q4<true>)
QMATMUL_HANDLER(q5_0, Q5<false>)
QMATMUL_HANDLER(q5_1, Q5<true>)
