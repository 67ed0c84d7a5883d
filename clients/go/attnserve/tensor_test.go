package attnserve

import (
	"math"
	"strings"
	"testing"

	pb "attnserve/clients/go/attnservepb"
)

func TestFloat32TensorRoundTrip(t *testing.T) {
	data := []float32{1, -2.5, float32(math.Inf(-1)), 3e-39, 0.1, 7}
	tensor, err := Float32Tensor(data, 2, 3)
	if err != nil {
		t.Fatal(err)
	}
	// Little-endian: 1.0f is 00 00 80 3f.
	if got := tensor.GetRawData()[:4]; string(got) != "\x00\x00\x80\x3f" {
		t.Fatalf("raw_data starts % x, want 00 00 80 3f", got)
	}
	back, err := Float32s(tensor)
	if err != nil {
		t.Fatal(err)
	}
	for i := range data {
		if back[i] != data[i] {
			t.Fatalf("element %d: %g, want %g", i, back[i], data[i])
		}
	}
}

func TestFloat32sOfFloatData(t *testing.T) {
	got, err := Float32s(&pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT32,
		Shape: []int64{2}, FloatData: []float32{4, 5}})
	if err != nil || len(got) != 2 || got[0] != 4 || got[1] != 5 {
		t.Fatalf("got %v, %v", got, err)
	}
}

func TestBFloat16RoundsToNearestEven(t *testing.T) {
	for _, c := range []struct {
		in   float32
		bits uint16
	}{
		{1, 0x3f80},
		{-2, 0xc000},
		{math.Float32frombits(0x3f808000), 0x3f80}, // tie, even below
		{math.Float32frombits(0x3f818000), 0x3f82}, // tie, even above
		{math.Float32frombits(0x3f808001), 0x3f81}, // above the tie
		{float32(math.Inf(1)), 0x7f80},
		{math.MaxFloat32, 0x7f80}, // rounds up to infinity
	} {
		if got := toBFloat16(c.in); got != c.bits {
			t.Errorf("toBFloat16(%g) = %#04x, want %#04x", c.in, got, c.bits)
		}
	}
	if nan := fromBFloat16(toBFloat16(float32(math.NaN()))); nan == nan {
		t.Errorf("NaN became %g", nan)
	}
}

func TestFloat16Widens(t *testing.T) {
	for bits, want := range map[uint16]float32{
		0x3c00: 1, 0xc000: -2, 0x7bff: 65504, 0x0001: 1.0 / (1 << 24),
		0x03ff: 1023.0 / (1 << 24), 0x7c00: float32(math.Inf(1)),
	} {
		if got := fromFloat16(bits); got != want {
			t.Errorf("fromFloat16(%#04x) = %g, want %g", bits, got, want)
		}
	}
	if got := fromFloat16(0x8000); got != 0 || !math.Signbit(float64(got)) {
		t.Errorf("fromFloat16(0x8000) = %g, want -0", got)
	}
}

func TestShapeMismatchesAreErrors(t *testing.T) {
	if _, err := Float32Tensor([]float32{1, 2, 3}, 2, 2); err == nil ||
		!strings.Contains(err.Error(), "3 values for shape [2 2], which has 4") {
		t.Errorf("Float32Tensor: %v", err)
	}
	if _, err := Float32s(&pb.Tensor{Dtype: pb.DataType_DATA_TYPE_FLOAT32,
		Shape: []int64{3}, RawData: make([]byte, 8)}); err == nil ||
		!strings.Contains(err.Error(), "has 8 bytes, expected 12") {
		t.Errorf("Float32s: %v", err)
	}
	if _, err := Float32s(&pb.Tensor{Dtype: pb.DataType_DATA_TYPE_BOOL,
		Shape: []int64{1}, RawData: []byte{1}}); err == nil {
		t.Error("Float32s of a BOOL tensor: no error")
	}
	if _, err := NumElements([]int64{1 << 40, 1 << 40}); err == nil {
		t.Error("NumElements: no overflow error")
	}
}
