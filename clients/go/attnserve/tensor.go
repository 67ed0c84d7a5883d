package attnserve

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	pb "attnserve/clients/go/attnservepb"
)

// Float32Tensor is a FLOAT32 tensor of the given shape (outermost dim
// first) holding data in row-major order, as little-endian raw_data.
func Float32Tensor(data []float32, shape ...int64) (*pb.Tensor, error) {
	if err := checkLength(len(data), shape); err != nil {
		return nil, err
	}
	raw := make([]byte, 4*len(data))
	for i, v := range data {
		binary.LittleEndian.PutUint32(raw[4*i:], math.Float32bits(v))
	}
	return &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT32,
		Shape: append([]int64(nil), shape...), RawData: raw}, nil
}

// BFloat16Tensor is a BFLOAT16 tensor of data rounded to the nearest
// bfloat16 (ties to even), half the bytes of Float32Tensor. The server
// widens BFLOAT16 inputs exactly, computes in float32 (on its bfloat16
// kernels only when a request sets compute_bf16) and answers in BFLOAT16.
func BFloat16Tensor(data []float32, shape ...int64) (*pb.Tensor, error) {
	if err := checkLength(len(data), shape); err != nil {
		return nil, err
	}
	raw := make([]byte, 2*len(data))
	for i, v := range data {
		binary.LittleEndian.PutUint16(raw[2*i:], toBFloat16(v))
	}
	return &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_BFLOAT16,
		Shape: append([]int64(nil), shape...), RawData: raw}, nil
}

// BoolTensor is a BOOL tensor, one byte per element: masks, where true
// keeps a position.
func BoolTensor(data []bool, shape ...int64) (*pb.Tensor, error) {
	if err := checkLength(len(data), shape); err != nil {
		return nil, err
	}
	raw := make([]byte, len(data))
	for i, v := range data {
		if v {
			raw[i] = 1
		}
	}
	return &pb.Tensor{Dtype: pb.DataType_DATA_TYPE_BOOL,
		Shape: append([]int64(nil), shape...), RawData: raw}, nil
}

// Float32s returns a tensor's values in row-major order: FLOAT32 ones from
// raw_data or float_data, BFLOAT16 and FLOAT16 ones widened exactly.
func Float32s(t *pb.Tensor) ([]float32, error) {
	if t == nil {
		return nil, errors.New("attnserve: no tensor")
	}
	if t.GetSharedMemory() != nil {
		return nil, errors.New(
			"attnserve: the tensor's values are in shared memory, not in the message")
	}
	n, err := NumElements(t.GetShape())
	if err != nil {
		return nil, err
	}
	raw := t.GetRawData()
	switch t.GetDtype() {
	case pb.DataType_DATA_TYPE_FLOAT32:
		if len(raw) == 0 && len(t.GetFloatData()) > 0 {
			if int64(len(t.GetFloatData())) != n {
				return nil, fmt.Errorf("attnserve: float_data holds %d values, "+
					"shape %v has %d", len(t.GetFloatData()), t.GetShape(), n)
			}
			return append([]float32(nil), t.GetFloatData()...), nil
		}
		if err := checkBytes(len(raw), n, 4, t); err != nil {
			return nil, err
		}
		out := make([]float32, n)
		for i := range out {
			out[i] = math.Float32frombits(binary.LittleEndian.Uint32(raw[4*i:]))
		}
		return out, nil
	case pb.DataType_DATA_TYPE_BFLOAT16, pb.DataType_DATA_TYPE_FLOAT16:
		if err := checkBytes(len(raw), n, 2, t); err != nil {
			return nil, err
		}
		widen := fromFloat16
		if t.GetDtype() == pb.DataType_DATA_TYPE_BFLOAT16 {
			widen = fromBFloat16
		}
		out := make([]float32, n)
		for i := range out {
			out[i] = widen(binary.LittleEndian.Uint16(raw[2*i:]))
		}
		return out, nil
	default:
		return nil, fmt.Errorf("attnserve: %v is not a floating-point dtype",
			t.GetDtype())
	}
}

// NumElements is the number of elements of a shape (1 for a scalar), or an
// error for negative dims and products that overflow int64.
func NumElements(shape []int64) (int64, error) {
	n := int64(1)
	for _, d := range shape {
		if d < 0 {
			return 0, fmt.Errorf("attnserve: negative dim in shape %v", shape)
		}
		if d != 0 && n > math.MaxInt64/d {
			return 0, fmt.Errorf("attnserve: shape %v overflows int64", shape)
		}
		n *= d
	}
	return n, nil
}

func checkLength(length int, shape []int64) error {
	n, err := NumElements(shape)
	if err != nil {
		return err
	}
	if n != int64(length) {
		return fmt.Errorf("attnserve: %d values for shape %v, which has %d",
			length, shape, n)
	}
	return nil
}

func checkBytes(length int, n int64, size int, t *pb.Tensor) error {
	if int64(length) != n*int64(size) {
		return fmt.Errorf("attnserve: %v tensor of shape %v has %d bytes, "+
			"expected %d", t.GetDtype(), t.GetShape(), length, n*int64(size))
	}
	return nil
}

// toBFloat16 rounds to the nearest bfloat16, ties to even; NaNs stay NaN.
func toBFloat16(v float32) uint16 {
	bits := math.Float32bits(v)
	if v != v {
		return uint16(bits>>16) | 0x40 // quiet, whatever the payload
	}
	bits += 0x7fff + (bits>>16)&1
	return uint16(bits >> 16)
}

func fromBFloat16(h uint16) float32 {
	return math.Float32frombits(uint32(h) << 16)
}

// fromFloat16 widens an IEEE half, subnormals, infinities and NaNs included.
func fromFloat16(h uint16) float32 {
	sign := uint32(h>>15) << 31
	exponent := uint32(h>>10) & 0x1f
	mantissa := uint32(h) & 0x3ff
	switch {
	case exponent == 0x1f: // infinity or NaN
		return math.Float32frombits(sign | 0x7f800000 | mantissa<<13)
	case exponent != 0:
		return math.Float32frombits(sign | (exponent+112)<<23 | mantissa<<13)
	default: // zero or subnormal: mantissa x 2^-24
		v := float32(mantissa) / (1 << 24)
		if sign != 0 {
			v = -v
		}
		return v
	}
}
