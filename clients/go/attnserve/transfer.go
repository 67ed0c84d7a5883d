package attnserve

// Moving a decode session between servers: ExportSession and ImportSession.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	pb "attnserve/clients/go/attnservepb"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// transferRetries is how many times a broken stream (UNAVAILABLE) is
// resumed, as the C++ client does.
const transferRetries = 2

// ExportSession returns the file of session sessionID (the --session_dir
// format), which ImportSession opens on any server. A stream that breaks
// (UNAVAILABLE) is resumed from the bytes it has, at the same session
// version; a session stepped meanwhile ends the export with ABORTED
// (export it again, or export a fork).
func (c *Client) ExportSession(ctx context.Context, sessionID string,
	options ...grpc.CallOption) ([]byte, error) {
	var data []byte
	var version uint64
	for attempt := 0; ; attempt++ {
		err := c.exportStream(ctx, sessionID, &data, &version, options)
		if err == nil {
			return data, nil
		}
		if status.Code(err) != codes.Unavailable || attempt == transferRetries {
			return nil, err
		}
	}
}

func (c *Client) exportStream(ctx context.Context, sessionID string,
	data *[]byte, version *uint64, options []grpc.CallOption) error {
	ctx, cancel := context.WithCancel(ctx) // ends the stream on every return
	defer cancel()
	stream, err := c.service.ExportSession(ctx, &pb.ExportSessionRequest{
		SessionId: sessionID, Offset: uint64(len(*data)), Version: *version},
		options...)
	if err != nil {
		return err
	}
	size := uint64(0)
	for {
		chunk, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err
		}
		if chunk.GetOffset() != uint64(len(*data)) {
			return fmt.Errorf("export: a chunk at offset %d after %d bytes",
				chunk.GetOffset(), len(*data))
		}
		*data = append(*data, chunk.GetData()...)
		*version, size = chunk.GetVersion(), chunk.GetSize()
	}
	if uint64(len(*data)) != size {
		return status.Errorf(codes.Unavailable,
			"export: the stream ended after %d of %d bytes", len(*data), size)
	}
	return nil
}

// ImportSession opens the session of file data (bytes ExportSession gave)
// under the id in the file, sending it in chunks of chunkBytes (at least
// 1). With sessionID (the exported session's), an import this or an
// earlier call left under way goes on from the bytes the server has taken,
// and a stream that breaks is resumed.
func (c *Client) ImportSession(ctx context.Context, data []byte,
	sessionID string, chunkBytes int,
	options ...grpc.CallOption) (*pb.ImportSessionResponse, error) {
	if chunkBytes < 1 {
		chunkBytes = 1
	}
	for attempt := 0; ; attempt++ {
		resumed, offset := "", uint64(0)
		if sessionID != "" {
			// A chunk without bytes asks how far the import got.
			progress, err := c.importStream(ctx, sessionID, nil, 0, chunkBytes,
				options)
			if err == nil {
				resumed, offset = sessionID, progress.GetReceived()
			} else if status.Code(err) == codes.Unavailable &&
				attempt < transferRetries {
				// The stream that broke may hold the import until the
				// server sees it end: ask again shortly.
				time.Sleep(time.Duration(attempt+1) * 100 * time.Millisecond)
				continue
			} else if status.Code(err) != codes.NotFound {
				return nil, err
			}
		}
		response, err := c.importStream(ctx, resumed, data, offset, chunkBytes,
			options)
		if err == nil && response.GetReceived() < response.GetSize() {
			err = status.Errorf(codes.Unavailable,
				"import: the server took %d of the file's %d bytes",
				response.GetReceived(), response.GetSize())
		}
		if err == nil {
			return response, nil
		}
		if status.Code(err) != codes.Unavailable || sessionID == "" ||
			attempt == transferRetries {
			return nil, err
		}
	}
}

func (c *Client) importStream(ctx context.Context, sessionID string,
	data []byte, offset uint64, chunkBytes int,
	options []grpc.CallOption) (*pb.ImportSessionResponse, error) {
	ctx, cancel := context.WithCancel(ctx) // ends the stream on every return
	defer cancel()
	stream, err := c.service.ImportSession(ctx, options...)
	if err != nil {
		return nil, err
	}
	// A send that fails with io.EOF means the server ended the stream:
	// CloseAndRecv tells why.
	if offset >= uint64(len(data)) {
		err = stream.Send(&pb.ImportSessionChunk{SessionId: sessionID,
			Offset: offset})
	}
	for at := offset; err == nil && at < uint64(len(data)); at += uint64(chunkBytes) {
		end := at + uint64(chunkBytes)
		if end > uint64(len(data)) {
			end = uint64(len(data))
		}
		err = stream.Send(&pb.ImportSessionChunk{
			SessionId: sessionID, Offset: at, Data: data[at:end]})
		sessionID = ""
	}
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	return stream.CloseAndRecv()
}
